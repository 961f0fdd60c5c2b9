// SequenceSlotManager: request ids -> dense slots in [0, max_num_slots).
// Free slots form a FIFO: initially 0..N-1, a freed slot goes to the back.
#pragma once

#include <chrono>
#include <deque>
#include <optional>
#include <unordered_map>

#include "inflight/batch_manager/common.h"

namespace inflight::batch_manager {

class SequenceSlotManager {
 public:
  using Clock = std::chrono::steady_clock;

  // Throws std::invalid_argument for max_num_slots < 1 or max_idle_seconds < 0.
  SequenceSlotManager(SizeType32 max_num_slots, double max_idle_seconds = 180.0);

  // The request's slot (refreshing its last-use time); when it has none and `start` is true, a new
  // slot from the front of the free FIFO. nullopt when full, or unknown with start == false.
  std::optional<SizeType32> get_sequence_slot(bool start, RequestIdType request_id);
  // Frees the request's slot; unknown ids are ignored (TRT-LLM's behaviour).
  void free_sequence_slot(RequestIdType request_id);
  // Frees every slot unused for longer than max_idle_seconds; returns the freed request ids.
  std::vector<RequestIdType> free_idle_sequence_slots();

  SizeType32 max_num_slots() const { return max_num_slots_; }
  SizeType32 num_free_slots() const { return static_cast<SizeType32>(free_slots_.size()); }
  SizeType32 num_used_slots() const { return static_cast<SizeType32>(slots_.size()); }

 private:
  struct Entry {
    SizeType32 slot;
    Clock::time_point last_used;
  };
  SizeType32 max_num_slots_;
  Clock::duration max_idle_;
  std::deque<SizeType32> free_slots_;
  std::unordered_map<RequestIdType, Entry> slots_;
};

}  // namespace inflight::batch_manager

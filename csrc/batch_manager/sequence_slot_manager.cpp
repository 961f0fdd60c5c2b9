// SequenceSlotManager: request ids -> dense slots, free slots in a FIFO (TRT-LLM semantics).
#include "inflight/batch_manager/sequence_slot_manager.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

namespace inflight::batch_manager {

namespace {

SequenceSlotManager::Clock::duration to_duration(double seconds) {
  using Duration = SequenceSlotManager::Clock::duration;
  std::chrono::duration<double> const requested(seconds);
  // A huge timeout (e.g. 1e300, or +inf meaning "never") would overflow the integer duration.
  if (!std::isfinite(seconds) || requested >= std::chrono::duration<double>(Duration::max())) {
    return Duration::max();
  }
  return std::chrono::duration_cast<Duration>(requested);
}

}  // namespace

SequenceSlotManager::SequenceSlotManager(SizeType32 max_num_slots, double max_idle_seconds)
    : max_num_slots_(max_num_slots) {
  if (max_num_slots < 1) {
    std::ostringstream message;
    message << "max_num_slots must be >= 1, got " << max_num_slots;
    throw std::invalid_argument(message.str());
  }
  // Written as a negated test so that NaN is rejected too.
  if (!(max_idle_seconds >= 0.0)) {
    std::ostringstream message;
    message << "max_idle_seconds must be >= 0, got " << max_idle_seconds;
    throw std::invalid_argument(message.str());
  }
  max_idle_ = to_duration(max_idle_seconds);
  for (SizeType32 slot = 0; slot < max_num_slots; ++slot) {
    free_slots_.push_back(slot);
  }
  slots_.reserve(static_cast<std::size_t>(max_num_slots));
}

std::optional<SizeType32> SequenceSlotManager::get_sequence_slot(bool start, RequestIdType request_id) {
  auto const now = Clock::now();
  auto it = slots_.find(request_id);
  if (it != slots_.end()) {
    it->second.last_used = now;
    return it->second.slot;
  }
  if (!start || free_slots_.empty()) {
    return std::nullopt;
  }
  SizeType32 const slot = free_slots_.front();
  free_slots_.pop_front();
  slots_.emplace(request_id, Entry{slot, now});
  return slot;
}

void SequenceSlotManager::free_sequence_slot(RequestIdType request_id) {
  auto it = slots_.find(request_id);
  if (it == slots_.end()) {
    return;
  }
  free_slots_.push_back(it->second.slot);
  slots_.erase(it);
}

std::vector<RequestIdType> SequenceSlotManager::free_idle_sequence_slots() {
  auto const now = Clock::now();
  std::vector<std::pair<SizeType32, RequestIdType>> idle;
  for (auto const& [request_id, entry] : slots_) {
    if (now - entry.last_used > max_idle_) {
      idle.emplace_back(entry.slot, request_id);
    }
  }
  // The map's iteration order is unspecified; freeing in slot order keeps the free FIFO (and so
  // the slots handed out next) deterministic.
  std::sort(idle.begin(), idle.end());
  std::vector<RequestIdType> freed;
  freed.reserve(idle.size());
  for (auto const& [slot, request_id] : idle) {
    free_slots_.push_back(slot);
    slots_.erase(request_id);
    freed.push_back(request_id);
  }
  return freed;
}

}  // namespace inflight::batch_manager

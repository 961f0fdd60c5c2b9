// A fake model loop driving CapacityScheduler -> pause -> MicroBatchScheduler -> KV accounting ->
// "forward", recording what ran in each iteration, so scheduler tests can be written as tables in
// the style of TRT-LLM's capacitySchedulerTest / microBatchSchedulerTest.
//
// One iteration:
//   1. requests arriving this iteration join the active list (descending priority, FIFO within equal);
//   2. capacity scheduler; each paused request: kv.remove_sequence, then pause(max_input_len);
//   3. micro batch scheduler over the fitting requests;
//   4. KV: add_sequence for scheduled contexts without a sequence, add_token for generation requests;
//   5. forward: contexts move_to_next_context_chunk; a finished context stores its blocks, becomes
//      GENERATION_IN_PROGRESS and gets its first token; every generation request gets one token;
//   6. a request with max_new_tokens generated is GENERATION_COMPLETE, its sequence removed.
// Generated tokens depend only on (request id, index since arrival), so a paused and recomputed
// request must end with exactly the tokens it would have had unpaused.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "inflight/batch_manager/capacity_scheduler.h"
#include "inflight/batch_manager/kv_cache_manager.h"
#include "inflight/batch_manager/llm_request.h"
#include "inflight/batch_manager/micro_batch_scheduler.h"

namespace inflight::batch_manager::testing {

struct RequestSpec {
  RequestIdType id;
  SizeType32 prompt_len;
  SizeType32 max_new_tokens;
  int arrival = 0;  // iteration at which the request joins the active list
  float priority = 0.5F;
  std::vector<TokenIdType> prompt = {};  // empty: tokens unique to this id
  SizeType32 num_draft_tokens = 0;       // draft tokens carried by its context until its last chunk runs
};

// A scheduled context as the forward pass sees it (after add_sequence, which may move the position
// on a prefix hit).
struct ContextChunk {
  SizeType32 position;
  SizeType32 chunk;
  SizeType32 num_draft_tokens = 0;
  bool operator==(ContextChunk const&) const = default;
};

struct StepRecord {
  std::vector<RequestIdType> context_ids;
  std::vector<RequestIdType> generation_ids;
  std::vector<ContextChunk> context_chunks;
  std::vector<RequestIdType> paused_ids;
};

// Expected for every iteration in [first, last]. Rows must cover 0..(number of iterations - 1)
// contiguously, so a table also pins down when the run ends.
struct ExpectedSteps {
  int first;
  int last;
  std::vector<RequestIdType> context_ids;
  std::vector<RequestIdType> generation_ids;
  std::vector<ContextChunk> context_chunks = {};  // checked when non-empty
  std::vector<RequestIdType> paused_ids = {};     // always checked
};

struct SimulationConfig {
  SizeType32 max_batch_size = 64;
  std::optional<SizeType32> max_num_tokens = std::nullopt;
  SizeType32 max_input_len = 1 << 20;
  // Request ids still in flight with the model at an iteration (pipeline parallelism).
  std::function<std::unordered_set<RequestIdType>(int)> inflight_ids = nullptr;
  int max_iterations = 500;
};

inline TokenIdType generated_token(RequestIdType id, SizeType32 index) {
  return static_cast<TokenIdType>(1'000'000 + id * 1000 + static_cast<RequestIdType>(index));
}

inline std::vector<TokenIdType> default_prompt(RequestIdType id, SizeType32 prompt_len) {
  std::vector<TokenIdType> tokens(static_cast<std::size_t>(prompt_len));
  for (SizeType32 i = 0; i < prompt_len; ++i) {
    tokens[static_cast<std::size_t>(i)] = static_cast<TokenIdType>(id * 10'000 + static_cast<RequestIdType>(i));
  }
  return tokens;
}

inline std::string ids_to_string(std::vector<RequestIdType> const& ids) {
  std::ostringstream out;
  out << "{";
  for (std::size_t i = 0; i < ids.size(); ++i) {
    out << (i ? ", " : "") << ids[i];
  }
  out << "}";
  return out.str();
}

inline std::ostream& operator<<(std::ostream& out, ContextChunk const& c) {
  return out << "{pos " << c.position << ", chunk " << c.chunk << ", drafts " << c.num_draft_tokens << "}";
}

class SchedulerSimulation {
 public:
  SchedulerSimulation(CapacityScheduler capacity, MicroBatchScheduler micro_batch, KVCacheManager* kv,
                      SimulationConfig config, std::vector<RequestSpec> specs)
      : capacity_(std::move(capacity)),
        micro_batch_(std::move(micro_batch)),
        kv_(kv),
        config_(std::move(config)),
        specs_(std::move(specs)) {}

  // Runs until every request has finished; returns one record per iteration.
  std::vector<StepRecord> run() {
    std::vector<StepRecord> records;
    std::size_t next_spec = 0;
    for (int it = 0; it < config_.max_iterations; ++it) {
      for (; next_spec < specs_.size() && specs_[next_spec].arrival <= it; ++next_spec) {
        arrive(specs_[next_spec]);
      }
      if (active_.empty() && next_spec == specs_.size()) {
        return records;
      }
      records.push_back(step(it));
      if (kv_ != nullptr) {
        kv_->check_integrity();
      }
    }
    ADD_FAILURE() << "simulation did not finish within " << config_.max_iterations << " iterations";
    return records;
  }

  // Every request finished with exactly the tokens an unpaused run would have produced.
  void expect_outputs_complete() const {
    for (auto const& spec : specs_) {
      auto const it =
          std::find_if(owned_.begin(), owned_.end(), [&](auto const& r) { return r->request_id() == spec.id; });
      ASSERT_NE(it, owned_.end()) << "request " << spec.id << " never arrived";
      LlmRequest const& request = **it;
      EXPECT_TRUE(request.is_finished()) << "request " << spec.id;
      std::vector<TokenIdType> expected = spec.prompt.empty() ? default_prompt(spec.id, spec.prompt_len) : spec.prompt;
      for (SizeType32 k = 0; k < spec.max_new_tokens; ++k) {
        expected.push_back(generated_token(spec.id, k));
      }
      EXPECT_EQ(request.tokens(), expected) << "request " << spec.id;
      EXPECT_EQ(request.num_tokens() - request.orig_prompt_len(), spec.max_new_tokens) << "request " << spec.id;
    }
    if (kv_ != nullptr) {
      EXPECT_EQ(kv_->num_sequences(), 0);
      EXPECT_EQ(kv_->num_free_blocks(), kv_->max_num_blocks());
    }
  }

  LlmRequest const& request(RequestIdType id) const {
    for (auto const& r : owned_) {
      if (r->request_id() == id) {
        return *r;
      }
    }
    throw std::out_of_range("unknown request id " + std::to_string(id));
  }

  // Requests paused at least once, with the iteration of each pause.
  std::vector<std::pair<int, RequestIdType>> const& pauses() const { return pauses_; }

 private:
  void arrive(RequestSpec const& spec) {
    std::vector<TokenIdType> prompt = spec.prompt.empty() ? default_prompt(spec.id, spec.prompt_len) : spec.prompt;
    auto request = std::make_unique<LlmRequest>(spec.id, spec.max_new_tokens, std::move(prompt), spec.priority);
    if (spec.num_draft_tokens > 0) {
      request->set_draft_tokens(std::vector<TokenIdType>(static_cast<std::size_t>(spec.num_draft_tokens), 7));
    }
    // Descending priority, FIFO within equal priority.
    auto const pos = std::find_if(active_.begin(), active_.end(),
                                  [&](LlmRequest const* r) { return r->priority() < spec.priority; });
    active_.insert(pos, request.get());
    owned_.push_back(std::move(request));
  }

  StepRecord step(int it) {
    StepRecord record;
    CapacitySchedulerOutput const capacity = capacity_.schedule(active_, kv_);
    for (LlmRequest* paused : capacity.paused_requests) {
      record.paused_ids.push_back(paused->request_id());
      pauses_.emplace_back(it, paused->request_id());
      if (kv_ != nullptr && kv_->has_sequence(paused->request_id())) {
        kv_->remove_sequence(paused->request_id(), paused);
      }
      paused->pause(config_.max_input_len);
    }

    std::unordered_set<RequestIdType> const inflight =
        config_.inflight_ids ? config_.inflight_ids(it) : std::unordered_set<RequestIdType>{};
    MicroBatchSchedulerOutput const batch =
        micro_batch_.schedule(capacity.fitting_requests, inflight, config_.max_batch_size, config_.max_num_tokens);

    for (LlmRequest* context : batch.context_requests) {
      if (kv_ != nullptr && !kv_->has_sequence(context->request_id())) {
        EXPECT_TRUE(context->is_first_context_chunk()) << "request " << context->request_id() << " at " << it;
        kv_->add_sequence(context->request_id(), context->prompt_len(), context->beam_width(), context);
      }
      record.context_ids.push_back(context->request_id());
      record.context_chunks.push_back(
          {context->context_current_position(), context->context_chunk_size(), context->num_draft_tokens()});
    }
    for (LlmRequest* generation : batch.generation_requests) {
      if (kv_ != nullptr) {
        kv_->add_token(generation->request_id());
      }
      record.generation_ids.push_back(generation->request_id());
    }

    for (LlmRequest* context : batch.context_requests) {
      context->move_to_next_context_chunk();
      if (context->context_remaining_length() == 0) {
        if (kv_ != nullptr) {
          kv_->store_context_blocks(*context);
        }
        context->set_state(LlmRequestState::kGENERATION_IN_PROGRESS);
        context->set_draft_tokens({});
        add_generated_token(*context);
      }
    }
    for (LlmRequest* generation : batch.generation_requests) {
      add_generated_token(*generation);
    }
    auto const finished = [&](LlmRequest* r) {
      if (!r->is_generation_in_progress_state() || r->num_generated_tokens() < r->max_new_tokens()) {
        return false;
      }
      r->set_state(LlmRequestState::kGENERATION_COMPLETE);
      r->set_finish_reason(FinishReason::kLENGTH);
      if (kv_ != nullptr) {
        kv_->remove_sequence(r->request_id(), r);
      }
      return true;
    };
    std::erase_if(active_, finished);
    return record;
  }

  static void add_generated_token(LlmRequest& request) {
    request.add_new_token(generated_token(request.request_id(), request.num_tokens() - request.orig_prompt_len()));
  }

  CapacityScheduler capacity_;
  MicroBatchScheduler micro_batch_;
  KVCacheManager* kv_;
  SimulationConfig config_;
  std::vector<RequestSpec> specs_;
  std::vector<std::unique_ptr<LlmRequest>> owned_;
  RequestVector active_;
  std::vector<std::pair<int, RequestIdType>> pauses_;
};

// Compares the records with the table; rows must tile 0..records.size()-1.
inline void expect_steps(std::vector<StepRecord> const& records, std::vector<ExpectedSteps> const& table) {
  int next = 0;
  for (auto const& row : table) {
    ASSERT_EQ(row.first, next) << "table rows must be contiguous";
    ASSERT_LE(row.first, row.last);
    for (int it = row.first; it <= row.last; ++it) {
      ASSERT_LT(static_cast<std::size_t>(it), records.size()) << "run ended before iteration " << it;
      StepRecord const& got = records[static_cast<std::size_t>(it)];
      EXPECT_EQ(got.context_ids, row.context_ids) << "iteration " << it << " context ids";
      EXPECT_EQ(got.generation_ids, row.generation_ids) << "iteration " << it << " generation ids";
      EXPECT_EQ(got.paused_ids, row.paused_ids) << "iteration " << it << " paused ids";
      if (!row.context_chunks.empty()) {
        EXPECT_EQ(got.context_chunks, row.context_chunks) << "iteration " << it << " context chunks";
      }
    }
    next = row.last + 1;
  }
  EXPECT_EQ(records.size(), static_cast<std::size_t>(next)) << "number of iterations";
}

// Prints the records as table rows (merging equal consecutive iterations): a debugging aid when a
// hand-derived table disagrees.
inline std::string format_records(std::vector<StepRecord> const& records) {
  std::ostringstream out;
  std::size_t i = 0;
  while (i < records.size()) {
    std::size_t j = i;
    while (j + 1 < records.size() && records[j + 1].context_ids == records[i].context_ids &&
           records[j + 1].generation_ids == records[i].generation_ids &&
           records[j + 1].context_chunks == records[i].context_chunks && records[j + 1].paused_ids.empty() &&
           records[i].paused_ids.empty()) {
      ++j;
    }
    out << "{" << i << ", " << j << ", " << ids_to_string(records[i].context_ids) << ", "
        << ids_to_string(records[i].generation_ids) << ", {";
    for (auto const& c : records[i].context_chunks) {
      out << c << " ";
    }
    out << "}, paused " << ids_to_string(records[i].paused_ids) << "}\n";
    i = j + 1;
  }
  return out.str();
}

}  // namespace inflight::batch_manager::testing

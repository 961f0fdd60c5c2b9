// Bindings of KVCacheManager and KvCacheStats (part of inflight._C; bind_batch_manager calls
// bind_kv_cache_manager). Mechanical, as batch_manager.cpp: same snake_case names as C++, read-only
// properties for getters, the GIL released around anything that loops.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "inflight/batch_manager/kv_cache_manager.h"
#include "request_list.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace inflight::bindings {
namespace bm = inflight::batch_manager;

namespace {

using BlockTableArray = nb::ndarray<std::int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Int32Vector = nb::ndarray<std::int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A NumPy array that owns `values` (shape [values.size() / cols, cols], or 1-D when cols == 0).
template <typename T>
nb::ndarray<nb::numpy, T> owned_array(std::vector<T> values, std::size_t cols = 0) {
  auto* heap = new std::vector<T>(std::move(values));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  std::size_t const shape[2] = {cols == 0 ? heap->size() : heap->size() / cols, cols};
  return nb::ndarray<nb::numpy, T>(heap->data(), cols == 0 ? 1 : 2, shape, owner);
}

std::vector<std::int32_t> to_vector(Int32Vector const& a) { return {a.data(), a.data() + a.shape(0)}; }

}  // namespace

void bind_kv_cache_manager(nb::module_& m) {
  nb::class_<bm::KvCacheStats>(m, "KvCacheStats")
      .def(nb::init<>())
      .def_rw("max_num_blocks", &bm::KvCacheStats::max_num_blocks)
      .def_rw("free_num_blocks", &bm::KvCacheStats::free_num_blocks)
      .def_rw("used_num_blocks", &bm::KvCacheStats::used_num_blocks)
      .def_rw("tokens_per_block", &bm::KvCacheStats::tokens_per_block)
      .def_rw("alloc_total_blocks", &bm::KvCacheStats::alloc_total_blocks)
      .def_rw("alloc_new_blocks", &bm::KvCacheStats::alloc_new_blocks)
      .def_rw("reused_blocks", &bm::KvCacheStats::reused_blocks)
      .def_rw("missed_blocks", &bm::KvCacheStats::missed_blocks)
      .def_rw("cache_hit_rate", &bm::KvCacheStats::cache_hit_rate)
      .def_rw("reusable_num_blocks", &bm::KvCacheStats::reusable_num_blocks)
      .def_rw("max_num_secondary_blocks", &bm::KvCacheStats::max_num_secondary_blocks)
      .def_rw("free_num_secondary_blocks", &bm::KvCacheStats::free_num_secondary_blocks)
      .def_rw("used_num_secondary_blocks", &bm::KvCacheStats::used_num_secondary_blocks)
      .def_rw("reusable_num_secondary_blocks", &bm::KvCacheStats::reusable_num_secondary_blocks)
      .def_rw("offloaded_blocks", &bm::KvCacheStats::offloaded_blocks)
      .def_rw("onboarded_blocks", &bm::KvCacheStats::onboarded_blocks)
      .def_rw("secondary_reused_blocks", &bm::KvCacheStats::secondary_reused_blocks)
      .def_rw("secondary_hit_rate", &bm::KvCacheStats::secondary_hit_rate)
      .def("to_dict",
           [](bm::KvCacheStats const& s) {
             nb::dict d;
             d["max_num_blocks"] = s.max_num_blocks;
             d["free_num_blocks"] = s.free_num_blocks;
             d["used_num_blocks"] = s.used_num_blocks;
             d["tokens_per_block"] = s.tokens_per_block;
             d["alloc_total_blocks"] = s.alloc_total_blocks;
             d["alloc_new_blocks"] = s.alloc_new_blocks;
             d["reused_blocks"] = s.reused_blocks;
             d["missed_blocks"] = s.missed_blocks;
             d["cache_hit_rate"] = s.cache_hit_rate;
             d["reusable_num_blocks"] = s.reusable_num_blocks;
             d["max_num_secondary_blocks"] = s.max_num_secondary_blocks;
             d["free_num_secondary_blocks"] = s.free_num_secondary_blocks;
             d["used_num_secondary_blocks"] = s.used_num_secondary_blocks;
             d["reusable_num_secondary_blocks"] = s.reusable_num_secondary_blocks;
             d["offloaded_blocks"] = s.offloaded_blocks;
             d["onboarded_blocks"] = s.onboarded_blocks;
             d["secondary_reused_blocks"] = s.secondary_reused_blocks;
             d["secondary_hit_rate"] = s.secondary_hit_rate;
             return d;
           })
      .def("__repr__", [](bm::KvCacheStats const& s) {
        std::ostringstream os;
        os << "KvCacheStats(max_num_blocks=" << s.max_num_blocks << ", free_num_blocks=" << s.free_num_blocks
           << ", used_num_blocks=" << s.used_num_blocks << ", tokens_per_block=" << s.tokens_per_block
           << ", alloc_total_blocks=" << s.alloc_total_blocks << ", alloc_new_blocks=" << s.alloc_new_blocks
           << ", reused_blocks=" << s.reused_blocks << ", missed_blocks=" << s.missed_blocks
           << ", cache_hit_rate=" << s.cache_hit_rate << ", reusable_num_blocks=" << s.reusable_num_blocks
           << ", max_num_secondary_blocks=" << s.max_num_secondary_blocks
           << ", free_num_secondary_blocks=" << s.free_num_secondary_blocks
           << ", used_num_secondary_blocks=" << s.used_num_secondary_blocks
           << ", reusable_num_secondary_blocks=" << s.reusable_num_secondary_blocks
           << ", offloaded_blocks=" << s.offloaded_blocks << ", onboarded_blocks=" << s.onboarded_blocks
           << ", secondary_reused_blocks=" << s.secondary_reused_blocks
           << ", secondary_hit_rate=" << s.secondary_hit_rate << ")";
        return os.str();
      });

  nb::class_<bm::KVCacheManager>(m, "KVCacheManager",
                                 "Accounting of a paged KV pool: block ids, prefix reuse, eviction. The "
                                 "memory itself is a tensor owned by the caller.")
      .def(nb::init<bm::SizeType32, bm::SizeType32, bm::SizeType32, bool, bm::SizeType32, bm::SizeType32,
                    bm::SizeType32>(),
           "num_blocks"_a, "tokens_per_block"_a, "max_seq_len"_a, "enable_block_reuse"_a = false,
           "num_secondary_blocks"_a = 0, "secondary_offload_min_priority"_a = bm::kDefaultSecondaryOffloadMinPriority,
           "attention_window"_a = 0)
      .def_prop_ro("max_num_blocks", &bm::KVCacheManager::max_num_blocks)
      .def_prop_ro("tokens_per_block", &bm::KVCacheManager::tokens_per_block)
      .def_prop_ro("max_seq_len", &bm::KVCacheManager::max_seq_len)
      .def_prop_ro("max_blocks_per_seq", &bm::KVCacheManager::max_blocks_per_seq)
      .def_prop_ro("enable_block_reuse", &bm::KVCacheManager::enable_block_reuse)
      .def_prop_ro("attention_window", &bm::KVCacheManager::attention_window,
                   "The window W of the layers this manager serves (0: global layers, nothing released).")
      .def_prop_ro("num_free_blocks", &bm::KVCacheManager::num_free_blocks)
      .def_prop_ro("num_used_blocks", &bm::KVCacheManager::num_used_blocks)
      .def_prop_ro("num_sequences", &bm::KVCacheManager::num_sequences)
      .def_prop_ro("scheduling_num_free_blocks", &bm::KVCacheManager::scheduling_num_free_blocks)
      .def_prop_ro("num_secondary_blocks", &bm::KVCacheManager::num_secondary_blocks)
      .def_prop_ro("num_free_secondary_blocks", &bm::KVCacheManager::num_free_secondary_blocks)
      .def_prop_ro("num_used_secondary_blocks", &bm::KVCacheManager::num_used_secondary_blocks)
      .def_prop_ro("secondary_offload_min_priority", &bm::KVCacheManager::secondary_offload_min_priority)
      .def_prop_ro("num_suspended_sequences", &bm::KVCacheManager::num_suspended_sequences)
      .def("has_sequence", &bm::KVCacheManager::has_sequence, "request_id"_a)
      .def("is_suspended", &bm::KVCacheManager::is_suspended, "request_id"_a,
           "Whether the sequence is swapped out (False for an unknown id).")
      .def("get_block_level", &bm::KVCacheManager::get_block_level, "block_id"_a,
           "PRIMARY_LEVEL (ids below max_num_blocks) or SECONDARY_LEVEL.")
      .def("add_sequence", &bm::KVCacheManager::add_sequence, "request_id"_a, "input_length"_a, "beam_width"_a = 1,
           nb::arg("request").none() = nb::none(), "max_reused_blocks"_a = -1)
      .def("count_reusable_blocks", &bm::KVCacheManager::count_reusable_blocks, "request"_a,
           "The prompt blocks add_sequence would reuse for the request now (0 with reuse off).")
      .def("slide_window", &bm::KVCacheManager::slide_window, "request_id"_a, "first_query_pos"_a,
           nb::arg("request").none() = nb::none(),
           "Releases the blocks no query at first_query_pos or later can see (stored for reuse first with "
           "reuse on and a request); a no-op without a window.")
      .def("get_num_held_blocks", &bm::KVCacheManager::get_num_held_blocks, "request_id"_a,
           "The blocks the sequence holds (those released by the window not counted).")
      .def("add_token", &bm::KVCacheManager::add_token, "request_id"_a)
      .def("add_tokens", &bm::KVCacheManager::add_tokens, "request_id"_a, "n"_a,
           "n more tokens at once (a speculative step's 1 + k), all or nothing.")
      .def("rewind", &bm::KVCacheManager::rewind, "request_id"_a, "n"_a,
           "Pops the last n tokens; blocks left empty are released, last first.")
      .def("fork_sequence", &bm::KVCacheManager::fork_sequence, "src_id"_a, "dst_id"_a,
           "Beam search: dst_id holds src_id's blocks (shared, ref-counted) and token count.")
      .def("take_block_copies", &bm::KVCacheManager::take_block_copies,
           "The (src_block, dst_block) copy-on-writes since the last call, to execute before the forward.")
      .def(
          "take_transfers",
          [](bm::KVCacheManager& kv) {
            std::vector<std::tuple<bm::KvTransferKind, bm::BlockIdType, bm::BlockIdType>> out;
            for (bm::KvBlockTransfer const& t : kv.take_transfers()) out.emplace_back(t.kind, t.src_block, t.dst_block);
            return out;
          },
          "The (kind, src_block, dst_block) moves between levels since the last call, to execute in order "
          "before the next forward (and before take_block_copies' copies).")
      .def("suspend_sequence", &bm::KVCacheManager::suspend_sequence, "request_id"_a,
           "Swap-out: the sequence's private blocks move to secondary blocks (offload transfers).")
      .def("resume_sequence", &bm::KVCacheManager::resume_sequence, "request_id"_a,
           "Swap-in: the suspended sequence's secondary blocks move to fresh primary blocks (onboard transfers).")
      .def("get_needed_blocks_to_resume", &bm::KVCacheManager::get_needed_blocks_to_resume, "request_id"_a)
      .def("get_needed_secondary_blocks_to_suspend", &bm::KVCacheManager::get_needed_secondary_blocks_to_suspend,
           "request_id"_a)
      .def("remove_sequence", &bm::KVCacheManager::remove_sequence, "request_id"_a,
           nb::arg("request").none() = nb::none())
      .def("store_context_blocks", &bm::KVCacheManager::store_context_blocks, "request"_a)
      .def("get_block_ids", &bm::KVCacheManager::get_block_ids, "request_id"_a,
           "The sequence's block ids, in token order (a copy); -1 for a block released by the window.")
      .def("get_num_tokens", &bm::KVCacheManager::get_num_tokens, "request_id"_a)
      .def(
          "copy_block_tables",
          [](bm::KVCacheManager const& kv, RequestList const& requests, BlockTableArray out) {
            std::vector<bm::RequestIdType> request_ids;
            request_ids.reserve(requests.size());
            for (auto* p : requests.ptrs()) request_ids.push_back(p->request_id());
            nb::gil_scoped_release release;
            kv.copy_block_tables(request_ids, out.data(), static_cast<std::int64_t>(out.shape(0)),
                                 static_cast<std::int64_t>(out.shape(1)));
          },
          "requests"_a, nb::arg("out").noconvert(),
          "Writes the block ids of each request's sequence into row i of `out` (int32, C-contiguous, "
          "[rows, cols]); the rest of each written row is set to 0.")
      .def(
          "copy_block_tables",
          [](bm::KVCacheManager const& kv, std::vector<bm::RequestIdType> const& request_ids, BlockTableArray out) {
            nb::gil_scoped_release release;
            kv.copy_block_tables(request_ids, out.data(), static_cast<std::int64_t>(out.shape(0)),
                                 static_cast<std::int64_t>(out.shape(1)));
          },
          "request_ids"_a, nb::arg("out").noconvert(),
          "Writes the block ids of each sequence into row i of `out` (int32, C-contiguous, [rows, cols]); the "
          "rest of each written row is set to 0.")
      .def("get_kv_cache_stats", &bm::KVCacheManager::get_kv_cache_stats)
      .def("start_scheduling", &bm::KVCacheManager::start_scheduling)
      .def("scheduling_remove_sequence", &bm::KVCacheManager::scheduling_remove_sequence, "request_id"_a)
      .def("get_needed_blocks_one_step", &bm::KVCacheManager::get_needed_blocks_one_step, "request"_a,
           "two_steps_lookahead"_a = false)
      .def("get_remaining_blocks_to_completion", &bm::KVCacheManager::get_remaining_blocks_to_completion, "request"_a)
      .def("find_new_context_block", &bm::KVCacheManager::find_new_context_block, "request"_a)
      .def(
          "export_secondary_blocks",
          [](bm::KVCacheManager const& kv) {
            bm::KvSecondaryBlocks b = kv.export_secondary_blocks();
            return nb::make_tuple(owned_array(std::move(b.block_ids)), owned_array(std::move(b.parents)),
                                  owned_array(std::move(b.priorities)),
                                  owned_array(std::move(b.tokens), static_cast<std::size_t>(kv.tokens_per_block())));
          },
          "The secondary level's reusable prefixes as int32 arrays (block_ids [n], parents [n] (-1: a first block), "
          "priorities [n], tokens [n, tokens_per_block]), in free-queue order (docs/batch-manager.md 3.10).")
      .def(
          "import_secondary_blocks",
          [](bm::KVCacheManager& kv, Int32Vector block_ids, Int32Vector parents, Int32Vector priorities,
             BlockTableArray tokens) {
            if (tokens.shape(1) != static_cast<std::size_t>(kv.tokens_per_block())) {
              throw std::invalid_argument("import_secondary_blocks: tokens must have tokens_per_block " +
                                          std::to_string(kv.tokens_per_block()) + " columns, got " +
                                          std::to_string(tokens.shape(1)));
            }
            kv.import_secondary_blocks({to_vector(block_ids),
                                        to_vector(parents),
                                        to_vector(priorities),
                                        {tokens.data(), tokens.data() + tokens.shape(0) * tokens.shape(1)}});
          },
          "block_ids"_a, "parents"_a, "priorities"_a, "tokens"_a,
          "Adopts an export_secondary_blocks() list into this fresh manager; ValueError (state unchanged) naming "
          "the entry of a malformed list.")
      .def("offload_reusable_blocks", &bm::KVCacheManager::offload_reusable_blocks,
           "Moves the free cached primary blocks into free uncached secondary blocks (before a shutdown).")
      .def("check_integrity", &bm::KVCacheManager::check_integrity);
}

}  // namespace inflight::bindings

// SequenceSlotManager: FIFO order of slots, refresh on use, full pool and idle timeout.
#include "inflight/batch_manager/sequence_slot_manager.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>

namespace inflight::batch_manager {
namespace {

using namespace std::chrono_literals;

TEST(SequenceSlotManager, HandsOutSlotsInOrder) {
  SequenceSlotManager slots(3);
  EXPECT_EQ(slots.max_num_slots(), 3);
  EXPECT_EQ(slots.num_free_slots(), 3);
  EXPECT_EQ(slots.get_sequence_slot(true, 10), 0);
  EXPECT_EQ(slots.get_sequence_slot(true, 11), 1);
  EXPECT_EQ(slots.get_sequence_slot(true, 12), 2);
  EXPECT_EQ(slots.num_free_slots(), 0);
  EXPECT_EQ(slots.num_used_slots(), 3);
}

TEST(SequenceSlotManager, ExistingRequestKeepsItsSlot) {
  SequenceSlotManager slots(3);
  EXPECT_EQ(slots.get_sequence_slot(true, 10), 0);
  EXPECT_EQ(slots.get_sequence_slot(true, 11), 1);
  EXPECT_EQ(slots.get_sequence_slot(false, 10), 0);
  EXPECT_EQ(slots.get_sequence_slot(true, 11), 1);
  EXPECT_EQ(slots.num_used_slots(), 2);
}

TEST(SequenceSlotManager, UnknownWithoutStartGetsNothing) {
  SequenceSlotManager slots(2);
  EXPECT_EQ(slots.get_sequence_slot(false, 7), std::nullopt);
  EXPECT_EQ(slots.num_free_slots(), 2);
  EXPECT_EQ(slots.get_sequence_slot(true, 8), 0);
}

TEST(SequenceSlotManager, FullReturnsNullopt) {
  SequenceSlotManager slots(2);
  EXPECT_EQ(slots.get_sequence_slot(true, 1), 0);
  EXPECT_EQ(slots.get_sequence_slot(true, 2), 1);
  EXPECT_EQ(slots.get_sequence_slot(true, 3), std::nullopt);
  EXPECT_EQ(slots.num_used_slots(), 2);
  // The existing holders still get theirs.
  EXPECT_EQ(slots.get_sequence_slot(true, 2), 1);
}

TEST(SequenceSlotManager, FreedSlotsGoToTheBack) {
  SequenceSlotManager slots(4);
  for (RequestIdType id = 0; id < 3; ++id) {
    EXPECT_EQ(slots.get_sequence_slot(true, id), static_cast<SizeType32>(id));
  }
  // Free FIFO now: 3. Freeing 1 then 0 makes it 3, 1, 0.
  slots.free_sequence_slot(1);
  slots.free_sequence_slot(0);
  EXPECT_EQ(slots.num_free_slots(), 3);
  EXPECT_EQ(slots.get_sequence_slot(true, 100), 3);
  EXPECT_EQ(slots.get_sequence_slot(true, 101), 1);
  EXPECT_EQ(slots.get_sequence_slot(true, 102), 0);
  EXPECT_EQ(slots.get_sequence_slot(true, 103), std::nullopt);
}

TEST(SequenceSlotManager, FreeUnknownIsIgnored) {
  SequenceSlotManager slots(2);
  EXPECT_EQ(slots.get_sequence_slot(true, 5), 0);
  slots.free_sequence_slot(6);
  slots.free_sequence_slot(5);
  slots.free_sequence_slot(5);
  EXPECT_EQ(slots.num_free_slots(), 2);
  EXPECT_EQ(slots.num_used_slots(), 0);
  // Free FIFO: 1, 0.
  EXPECT_EQ(slots.get_sequence_slot(true, 7), 1);
  EXPECT_EQ(slots.get_sequence_slot(true, 8), 0);
}

TEST(SequenceSlotManager, IdleSlotsAreFreedInSlotOrder) {
  SequenceSlotManager slots(4, 0.0);
  EXPECT_EQ(slots.get_sequence_slot(true, 30), 0);
  EXPECT_EQ(slots.get_sequence_slot(true, 10), 1);
  EXPECT_EQ(slots.get_sequence_slot(true, 20), 2);
  std::this_thread::sleep_for(2ms);
  std::vector<RequestIdType> const freed = slots.free_idle_sequence_slots();
  EXPECT_EQ(freed, (std::vector<RequestIdType>{30, 10, 20}));
  EXPECT_EQ(slots.num_used_slots(), 0);
  // Free FIFO: 3 (never used), then the freed slots 0, 1, 2.
  EXPECT_EQ(slots.get_sequence_slot(true, 1), 3);
  EXPECT_EQ(slots.get_sequence_slot(true, 2), 0);
  EXPECT_EQ(slots.get_sequence_slot(true, 3), 1);
  EXPECT_EQ(slots.get_sequence_slot(true, 4), 2);
}

TEST(SequenceSlotManager, UseRefreshesIdleTime) {
  // Margins of 150 ms either side of the timeout keep this stable on a loaded machine.
  SequenceSlotManager slots(2, 0.5);
  EXPECT_EQ(slots.get_sequence_slot(true, 1), 0);
  EXPECT_EQ(slots.get_sequence_slot(true, 2), 1);
  std::this_thread::sleep_for(350ms);
  EXPECT_EQ(slots.get_sequence_slot(false, 1), 0);
  EXPECT_TRUE(slots.free_idle_sequence_slots().empty());
  std::this_thread::sleep_for(350ms);
  EXPECT_EQ(slots.free_idle_sequence_slots(), (std::vector<RequestIdType>{2}));
  EXPECT_EQ(slots.get_sequence_slot(false, 1), 0);
  EXPECT_EQ(slots.get_sequence_slot(false, 2), std::nullopt);
}

TEST(SequenceSlotManager, DefaultTimeoutFreesNothingSoon) {
  SequenceSlotManager slots(2);
  EXPECT_EQ(slots.get_sequence_slot(true, 1), 0);
  EXPECT_TRUE(slots.free_idle_sequence_slots().empty());
  EXPECT_EQ(slots.num_used_slots(), 1);
}

TEST(SequenceSlotManager, HugeTimeoutsDoNotOverflow) {
  for (double seconds : {1e300, std::numeric_limits<double>::infinity()}) {
    SequenceSlotManager slots(1, seconds);
    EXPECT_EQ(slots.get_sequence_slot(true, 1), 0);
    EXPECT_TRUE(slots.free_idle_sequence_slots().empty());
  }
}

void expect_invalid_argument(SizeType32 max_num_slots, double max_idle_seconds, std::string const& fragment) {
  try {
    SequenceSlotManager slots(max_num_slots, max_idle_seconds);
    FAIL() << "expected std::invalid_argument mentioning " << fragment;
  } catch (std::invalid_argument const& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

TEST(SequenceSlotManager, RejectsBadArguments) {
  expect_invalid_argument(0, 1.0, "max_num_slots must be >= 1, got 0");
  expect_invalid_argument(-3, 1.0, "max_num_slots must be >= 1, got -3");
  expect_invalid_argument(2, -0.5, "max_idle_seconds must be >= 0, got -0.5");
  expect_invalid_argument(2, std::nan(""), "max_idle_seconds");
}

}  // namespace
}  // namespace inflight::batch_manager

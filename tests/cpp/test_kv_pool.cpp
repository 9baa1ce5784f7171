// Page pool and bucketed-LRU unit tests.
#include <gtest/gtest.h>

#include "kv/page_pool.h"

namespace spin::kv {
namespace {

TEST(KvPagePool, AllocatesEveryPageOnceThenThrowsTyped) {
  PagePool pool(Tier::Device, 5, 4096);
  EXPECT_EQ(pool.capacity_bytes(), 5u * 4096);
  std::vector<bool> seen(5, false);
  for (int i = 0; i < 5; ++i) {
    const uint32_t id = pool.alloc();
    ASSERT_LT(id, 5u);
    EXPECT_FALSE(seen[id]);
    seen[id] = true;
  }
  EXPECT_EQ(pool.num_free(), 0u);
  EXPECT_EQ(pool.used_bytes(), 5u * 4096);
  try {
    pool.alloc();
    FAIL() << "expected PoolExhausted";
  } catch (const PoolExhausted& e) {
    EXPECT_EQ(e.requested(), 1u);
    EXPECT_EQ(e.available(), 0u);
  }
  pool.free(3);
  EXPECT_EQ(pool.alloc(), 3u);
  EXPECT_THROW(pool.free(7), Error);
  pool.free(2);
  EXPECT_THROW(pool.free(2), Error);  // double free
}

}  // namespace
}  // namespace spin::kv

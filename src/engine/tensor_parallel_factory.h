#pragma once
// Attention for a tensor-parallel model (model/tensor_parallel.h): every rank has its own
// factory over its own KV heads (its own pools, page tables and LRU), and a request's KV is one
// handle per rank (TensorParallelKv). The engine sees one factory and runs unchanged.
#include <functional>
#include <memory>
#include <vector>

#include "engine/attention_factory.h"
#include "model/tensor_parallel.h"

namespace spin {

// ranks[r] makes rank r's KV (for rank_attention_shape()). Demand and capacity: device and host
// pages add up over the ranks (each holds its KV heads' pages); blocks count tokens, which every
// rank stores alike, so they are the largest rank's. Usage adds pages, bytes and counters.
std::unique_ptr<AttentionFactory> make_tensor_parallel_attention_factory(
    std::vector<std::unique_ptr<AttentionFactory>> ranks);

// Makes rank `rank`'s attention factory for its share of the heads.
using RankFactoryMaker =
    std::function<std::unique_ptr<AttentionFactory>(int rank, const AttentionShape& rank_shape)>;

struct TensorParallel {
  std::unique_ptr<TensorParallelModel> model;
  std::unique_ptr<AttentionFactory> factory;  // pass to the Engine with the model
};

// The CPU model over `world` ranks (make_cpu_tensor_parallel_model) and its factory. make_rank_factory: null = dense contiguous
// attention on every rank. threads: CPU threads all ranks share (0 = the OpenMP default).
// Throws spin::Error naming the numbers when world does not divide the KV heads (and the query
// heads and the intermediate size).
TensorParallel make_tensor_parallel(const ModelWeights& weights, int world,
                                    const RankFactoryMaker& make_rank_factory = nullptr,
                                    int threads = 0);

}  // namespace spin

"""PyTorch SDPA decode attention (cuDNN and flash backends) on the shapes of
gpu_kernels_bench.cu's dense benchmark, as CSV rows bench,config,variant,time_us,bytes,gbps;
then causal prefill on the shapes of its prefill benchmark (rows `prefill`: the bytes column
holds the causal FLOPs 2*2*heads*d*n^2/2, gbps GFLOP/s).

Contiguous bf16 K/V [B, Hkv, S, 128], q [B, Hq, 1, 128], GQA through enable_gqa. Timing matches
the spin side: a CUDA graph of max(copies, 4) calls rotating over input copies (>= 512 MB per
graph, so L2 serves none), warm-up replays (>= 3 and >= 50 ms, so clocks settle after the
previous shape), median of 25 timed replays; eager calls if a
backend cannot be captured. Bytes: K + V read, q read, out written.
Prefill: one sequence, q [1, 32, n, 128], contiguous K/V [1, 8, n, 128], is_causal=True,
enable_gqa=True (K/V expanded to 32 heads if a backend refuses GQA; the row says so); a graph of
2 calls on the same inputs (compute-bound: L2 reuse across calls does not matter).
"""
import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROTATE_BYTES = 512 << 20
TIMED = 25
WARMUP_MS = 50.0


def time_calls(fn, calls):
    stream = torch.cuda.Stream()
    mode = "graph"
    try:
        with torch.cuda.stream(stream):
            for i in range(calls):  # warm-up outside the capture (workspace, handles)
                fn(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(i)
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager timing
        print(f"  graph capture failed ({type(exc).__name__}: {exc}); timing eager calls",
              file=sys.stderr)
        mode = "eager"
        torch.cuda.synchronize()

        def run():
            for i in range(calls):
                fn(i)
    # Warm-up as on the spin side: at least 3 replays and WARMUP_MS of them.
    warm_start, warm_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    warm_start.record()
    replays = 0
    while True:
        run()
        replays += 1
        warm_end.record()
        warm_end.synchronize()
        if replays >= 3 and warm_start.elapsed_time(warm_end) >= WARMUP_MS:
            break
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(TIMED):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times), mode


def main():
    parser = argparse.ArgumentParser(description="PyTorch SDPA decode and prefill attention timings (CSV).")
    parser.add_argument("out", nargs="?", help="CSV file (default: stdout)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--prefill-only", action="store_true", help="time only the prefill shapes")
    only.add_argument("--decode-only", action="store_true", help="time only the decode shapes")
    args = parser.parse_args()
    prefill_only = args.prefill_only
    out = open(args.out, "w") if args.out else sys.stdout
    out.write("bench,config,variant,time_us,bytes,gbps\n")
    d, hkv = 128, 8
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]
    for context in () if prefill_only else (32768, 131072):
        for group in (5, 4):
            for batch in (1, 8, 32):
                hq = hkv * group
                kv_bytes = batch * hkv * context * d * 2 * 2
                copies = max(1, -(-ROTATE_BYTES // kv_bytes))
                torch.cuda.empty_cache()
                gen = torch.Generator(device="cuda").manual_seed(1)
                qs, ks, vs = [], [], []
                for _ in range(copies):
                    qs.append(torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen))
                    ks.append(torch.randn(batch, hkv, context, d, device="cuda", dtype=torch.bfloat16, generator=gen))
                    vs.append(torch.randn(batch, hkv, context, d, device="cuda", dtype=torch.bfloat16, generator=gen))
                nbytes = kv_bytes + 2 * batch * hq * d * 2
                config = f"hq{hq}/hkv8 B{batch} ctx{context // 1024}K"
                for name, backend in backends:
                    def call(i, backend=backend):
                        c = i % copies
                        with sdpa_kernel([backend]):
                            return F.scaled_dot_product_attention(qs[c], ks[c], vs[c], enable_gqa=True)
                    try:
                        t, mode = time_calls(call, max(copies, 4))
                    except Exception as exc:  # noqa: BLE001 - report and go on
                        print(f"{config} {name}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                        continue
                    gbps = nbytes / (t * 1e-6) / 1e9
                    out.write(f"dense,{config},torch {name} {mode},{t:.3f},{nbytes},{gbps:.2f}\n")
                    out.flush()
                    print(f"dense    {config:28s} torch {name} {mode:6s} {t:10.2f} us {gbps:9.1f} GB/s", flush=True)
                del qs, ks, vs
    if not args.decode_only:
        prefill(out, backends)


def prefill(out, backends):
    d, hkv, hq = 128, 8, 32
    for n in (4096, 16384, 32768):
        torch.cuda.empty_cache()
        gen = torch.Generator(device="cuda").manual_seed(2)
        q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        flops = 4 * hq * d * n * n / 2
        config = f"hq32/hkv8 d128 {n // 1024}K"
        for name, backend in backends:
            result = None
            for expanded in (False, True):
                kk = k.repeat_interleave(hq // hkv, dim=1) if expanded else k
                vv = v.repeat_interleave(hq // hkv, dim=1) if expanded else v

                def call(_i, backend=backend, kk=kk, vv=vv, expanded=expanded):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True,
                                                              enable_gqa=not expanded)
                try:
                    result = time_calls(call, 2), expanded
                    break
                except Exception as exc:  # noqa: BLE001 - report, then try expanded K/V or go on
                    print(f"{config} {name} expanded={expanded}: {type(exc).__name__}: {str(exc)[:200]}",
                          file=sys.stderr)
            if result is None:
                continue
            (t, mode), expanded = result
            variant = f"torch {name}{' kv-expanded' if expanded else ''} {mode}"
            gflops = flops / (t * 1e-6) / 1e9
            out.write(f"prefill,{config},{variant},{t:.3f},{flops:.0f},{gflops:.2f}\n")
            out.flush()
            print(f"prefill  {config:28s} {variant:24s} {t:10.2f} us {gflops / 1e3:9.1f} TFLOP/s", flush=True)
        del q, k, v


if __name__ == "__main__":
    main()

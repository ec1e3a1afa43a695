"""Benchmarks sao_actor_learner.kernels against eager PyTorch on the same inputs, in one run.

    python programs/benchmarks/kernels.py --out_json=kernels.json      # CUDA: the full grid
    python programs/benchmarks/kernels.py --smoke                      # tiny shapes; on CPU it
                                                                       # sets TRITON_INTERPRET=1

Per kernel and size: time (CUDA events, median of --repeats after --warmup; wall clock on CPU),
peak memory above the inputs (torch.cuda.max_memory_allocated; not measured on CPU), and the
achieved fraction of the GPU's peaks. Peaks are the vendor's H100/H200 SXM figures, stated in
the JSON: 989 TFLOP/s dense bf16 and 4.8 TB/s HBM3e (H200; an H100 SXM has 3.35 TB/s). A bf16
8192^3 torch.mm is also timed on the spot (`measured_matmul_tflops`) as a practical ceiling.

- fused_logprobs (N tokens, H hidden, V=151936): Triton fwd+bwd vs eager "materialised logits
  + log_softmax(fp32) + gather" fwd+bwd (what learner.losses.token_logprobs does), and
  forward only. FLOPs: eager executes 6NVH, the fused kernels 8NVH (the backward recomputes the
  logits); `tflops` counts what each executes, `model_tflops` counts 6NVH for both.
- dis_loss ([N/2048, 2048] tokens): Triton vs learner.losses.dis_policy_loss, fwd+bwd+stats.
- skip_observation_gae ([N/2048, 2048]): Triton vs the reference's torch loop (on the GPU) and
  a naive Python loop over host lists.
Where eager runs out of memory the entry says "oom". The last line printed is one JSON object.
Targets (from the issue): fused log-probs fwd+bwd >= 1.5x faster than eager with >= 4x lower
peak memory; GAE >= 20x faster than the torch loop.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    # The CPU smoke run uses Triton's interpreter; it must be on before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from sao_actor_learner import kernels as K  # noqa: E402
from sao_actor_learner.learner import advantages as ref_adv  # noqa: E402
from sao_actor_learner.learner import losses as ref_losses  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["8192x2048", "8192x4096", "32768x2048", "32768x4096"],
                  "comma-separated NxH: tokens x hidden size")
flags.DEFINE_integer("vocab", 151936, "vocabulary size V")
flags.DEFINE_enum("dtype", "bf16", ["bf16", "fp16", "fp32"], "dtype of hidden and LM head")
flags.DEFINE_integer("repeats", 3, "timed repetitions (median reported)")
flags.DEFINE_integer("warmup", 1, "untimed repetitions first (compiles the Triton kernels)")
flags.DEFINE_integer("row_len", 2048, "tokens per row for dis_loss and GAE ([N/row_len, row_len])")
flags.DEFINE_list("kernels", ["fused_logprobs", "dis_loss", "gae"], "which kernels to run")
flags.DEFINE_string("out_json", "", "also write the JSON result here")
flags.DEFINE_bool("smoke", False, "tiny shapes (N=64, H=32, V=300, rows of 16): a quick check "
                  "that runs on CPU with the Triton interpreter")

PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM, dense bf16, vendor datasheet
PEAK_HBM_TBPS = 4.8  # H200 HBM3e, vendor datasheet
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OOM = (torch.cuda.OutOfMemoryError, MemoryError)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ms(fn, warmup: int, repeats: int) -> float:
    """Median milliseconds of fn(): CUDA events on CUDA, perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(max(1, repeats)):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def peak_gb(fn):
    """(peak bytes allocated above what was allocated before fn, absolute peak) in GB; CUDA only."""
    if not torch.cuda.is_available():
        return None, None
    _sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    _sync()
    peak = torch.cuda.max_memory_allocated()
    return (peak - base) / 1e9, peak / 1e9


def measure(name: str, fn, warmup: int, repeats: int) -> dict:
    """Time and peak memory of fn, or {"status": "oom"}."""
    try:
        ms = time_ms(fn, warmup, repeats)
        extra, absolute = peak_gb(fn)
        return {"impl": name, "status": "ok", "ms": ms, "peak_extra_gb": extra,
                "peak_abs_gb": absolute}
    except OOM as e:
        return {"impl": name, "status": "oom", "error": str(e).splitlines()[0][:200]}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def matmul_ceiling_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.mm(a, b), 3, 10)
    del a, b
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def bench_logprobs(n: int, h: int, v: int, dtype, device, warmup, repeats) -> list:
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, device=device, dtype=dtype, generator=gen) / h ** 0.5
              ).requires_grad_()
    targets = torch.randint(0, v, (n,), device=device, generator=gen)
    grad = torch.randn(n, device=device, generator=gen)

    def fused_fwd_bwd():
        hidden.grad = weight.grad = None
        K.fused_logprobs(hidden, weight, targets, backend="triton").backward(grad)

    def eager_fwd_bwd():
        hidden.grad = weight.grad = None
        logits = hidden @ weight.t()
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        lp.backward(grad)

    def fused_fwd():
        with torch.no_grad():
            K.fused_logprobs(hidden, weight, targets, backend="triton")

    def eager_fwd():
        with torch.no_grad():
            logits = hidden @ weight.t()
            torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])

    nvh = n * v * h
    out = []
    for impl, fb, fw, executed in (("triton", fused_fwd_bwd, fused_fwd, 8 * nvh),
                                   ("eager", eager_fwd_bwd, eager_fwd, 6 * nvh)):
        r = measure(impl, fb, warmup, repeats)
        r.update(kernel="fused_logprobs", N=n, H=h, V=v, phase="fwd+bwd")
        if r["status"] == "ok":
            s = r["ms"] * 1e-3
            r["tflops"] = executed / s / 1e12
            r["model_tflops"] = 6 * nvh / s / 1e12
            r["frac_peak_bf16"] = r["tflops"] / PEAK_BF16_TFLOPS
        out.append(r)
        f = measure(impl, fw, warmup, repeats)
        f.update(kernel="fused_logprobs", N=n, H=h, V=v, phase="fwd")
        if f["status"] == "ok":
            f["tflops"] = 2 * nvh / (f["ms"] * 1e-3) / 1e12
            f["frac_peak_bf16"] = f["tflops"] / PEAK_BF16_TFLOPS
        out.append(f)
    hidden.grad = weight.grad = None
    del hidden, weight
    return out


def _rows(n: int, row_len: int):
    return max(1, n // row_len), min(row_len, n)


def _ragged_mask(b: int, t: int, device, gen) -> torch.Tensor:
    """Prompt, then turns of action tokens separated by observation tokens; ragged row ends."""
    pos = torch.arange(t, device=device)
    end = torch.randint(t // 2, t + 1, (b, 1), device=device, generator=gen)
    turns = (pos // 64) % 3 != 2  # two blocks of actions, then an observation block
    return (pos >= t // 8) & (pos < end) & turns


def bench_dis(n: int, row_len: int, device, warmup, repeats) -> list:
    b, t = _rows(n, row_len)
    gen = torch.Generator(device=device).manual_seed(1)
    logp = (-torch.rand(b, t, device=device, generator=gen) * 3).requires_grad_()
    rollout = logp.detach() + 0.2 * torch.randn(b, t, device=device, generator=gen)
    adv = torch.randn(b, t, device=device, generator=gen)
    mask = _ragged_mask(b, t, device, gen)

    def run(backend):
        def step():
            logp.grad = None
            if backend == "triton":
                loss, _ = K.dis_loss(logp, rollout, adv, mask, 0.3, 5.0, backend="triton")
            else:
                loss, _ = ref_losses.dis_policy_loss(logp, rollout, adv, mask, 0.3, 5.0)
            loss.backward()
        return step

    bytes_moved = b * t * (4 * 3 + 1 + 4 + 4 + 4)  # 3 fp32 + mask in, coef out, coef in, grad out
    out = []
    for impl in ("triton", "eager"):
        r = measure(impl, run(impl), warmup, repeats)
        r.update(kernel="dis_loss", N=b * t, B=b, T=t, phase="fwd+bwd+stats")
        if r["status"] == "ok":
            r["gbps"] = bytes_moved / (r["ms"] * 1e-3) / 1e9
            r["frac_peak_hbm"] = r["gbps"] / (PEAK_HBM_TBPS * 1e3)
        out.append(r)
    return out


def naive_python_gae(rewards, values, mask, gamma, lam):
    """The obvious per-token loop over host lists (no bootstrap)."""
    adv_rows = []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        adv = [0.0] * len(r_row)
        next_v, next_a = 0.0, 0.0
        for t in range(len(r_row) - 1, -1, -1):
            if m_row[t]:
                a = r_row[t] + gamma * next_v - v_row[t] + gamma * lam * next_a
                adv[t], next_v, next_a = a, v_row[t], a
        adv_rows.append(adv)
    return adv_rows


def bench_gae(n: int, row_len: int, device, warmup, repeats) -> list:
    b, t = _rows(n, row_len)
    gen = torch.Generator(device=device).manual_seed(2)
    rewards = torch.randn(b, t, device=device, generator=gen)
    values = torch.randn(b, t, device=device, generator=gen)
    mask = _ragged_mask(b, t, device, gen)
    gamma, lam = 1.0, 0.95

    def triton_step():
        K.skip_observation_gae(rewards, values, mask, gamma, lam, backend="triton")

    def torch_loop_step():
        ref_adv.skip_observation_gae(rewards, values, mask, gamma, lam)

    def python_step():
        naive_python_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)

    bytes_moved = b * t * (4 + 4 + 1 + 4 + 4)
    out = []
    for impl, fn, reps in (("triton", triton_step, repeats), ("torch_loop", torch_loop_step, 1),
                           ("python_loop", python_step, 1)):
        r = measure(impl, fn, min(warmup, 1), reps)
        r.update(kernel="skip_observation_gae", N=b * t, B=b, T=t, phase="fwd")
        if r["status"] == "ok":
            r["gbps"] = bytes_moved / (r["ms"] * 1e-3) / 1e9
            r["frac_peak_hbm"] = r["gbps"] / (PEAK_HBM_TBPS * 1e3)
        out.append(r)
    return out


def summarize(results: list) -> list:
    def find(kernel, impl, phase=None, **dims):
        for r in results:
            if (r["kernel"] == kernel and r["impl"] == impl
                    and (phase is None or r["phase"] == phase)
                    and all(r.get(k) == v for k, v in dims.items())):
                return r
        return None

    summary = []
    for r in results:
        if r["kernel"] == "fused_logprobs" and r["impl"] == "triton" and r["phase"] == "fwd+bwd":
            e = find("fused_logprobs", "eager", "fwd+bwd", N=r["N"], H=r["H"])
            s = {"kernel": "fused_logprobs", "N": r["N"], "H": r["H"]}
            if r["status"] != "ok" or e is None:
                s["status"] = "triton " + r["status"]
            elif e["status"] == "oom":
                s.update(status="eager oom", meets_time_target=True, meets_memory_target=True)
            else:
                s["speedup"] = e["ms"] / r["ms"]
                s["meets_time_target"] = s["speedup"] >= 1.5
                if r.get("peak_extra_gb"):
                    s["memory_ratio"] = e["peak_extra_gb"] / r["peak_extra_gb"]
                    s["meets_memory_target"] = s["memory_ratio"] >= 4.0
        elif r["kernel"] == "skip_observation_gae" and r["impl"] == "triton":
            s = {"kernel": "skip_observation_gae", "N": r["N"]}
            for base in ("torch_loop", "python_loop"):
                e = find("skip_observation_gae", base, N=r["N"])
                if e and e["status"] == "ok" and r["status"] == "ok":
                    s[f"speedup_vs_{base}"] = e["ms"] / r["ms"]
            if "speedup_vs_torch_loop" in s:
                s["meets_time_target"] = s["speedup_vs_torch_loop"] >= 20.0
        elif r["kernel"] == "dis_loss" and r["impl"] == "triton":
            e = find("dis_loss", "eager", N=r["N"])
            s = {"kernel": "dis_loss", "N": r["N"]}
            if e and e["status"] == "ok" and r["status"] == "ok":
                s["speedup"] = e["ms"] / r["ms"]
        else:
            continue
        summary.append(s)
    return summary


def print_table(results: list) -> None:
    print(f"{'kernel':22} {'impl':12} {'phase':14} {'N':>6} {'H':>5} {'ms':>10} "
          f"{'peak+GB':>8} {'TFLOP/s':>8} {'%bf16':>6} {'GB/s':>8} {'%HBM':>6}")
    for r in results:
        def f(key, fmt):
            x = r.get(key)
            return format(x, fmt) if isinstance(x, (int, float)) else "-"
        ms = f("ms", ".3f") if r["status"] == "ok" else r["status"]
        frac_f = r.get("frac_peak_bf16")
        frac_b = r.get("frac_peak_hbm")
        print(f"{r['kernel']:22} {r['impl']:12} {r['phase']:14} {r['N']:>6} "
              f"{str(r.get('H', '-')):>5} {ms:>10} {f('peak_extra_gb', '.2f'):>8} "
              f"{f('tflops', '.1f'):>8} {format(100 * frac_f, '.1f') if frac_f else '-':>6} "
              f"{f('gbps', '.1f'):>8} {format(100 * frac_b, '.2f') if frac_b else '-':>6}")


def parse_size(text: str):
    """Parses NxH, e.g. 32768x4096 or 32kx4096 -> (32768, 4096)."""
    def num(x):
        x = x.strip().lower()
        return int(x[:-1]) * 1024 if x.endswith("k") else int(x)
    try:
        n, h = text.lower().split("x")
        return num(n), num(h)
    except ValueError:
        raise app.UsageError(f"--sizes entry {text!r}: must be NxH, e.g. 32768x4096 or 32kx4096")


def main(argv):
    del argv
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not FLAGS.smoke:
        raise app.UsageError("no CUDA device: the full benchmark needs a GPU; run with --smoke "
                             "for the tiny CPU configuration (Triton interpreter)")
    if not K.triton_available(device):
        raise app.UsageError("the Triton backend cannot run here: install triton, and on CPU "
                             "set TRITON_INTERPRET=1 before triton is imported (--smoke does)")
    dtype = DTYPES[FLAGS.dtype]
    if FLAGS.smoke:
        sizes, vocab, row_len, warmup, repeats = [(64, 32)], 300, 16, 0, 1
    else:
        sizes = [parse_size(s) for s in FLAGS.sizes]
        vocab, row_len, warmup, repeats = FLAGS.vocab, FLAGS.row_len, FLAGS.warmup, FLAGS.repeats
    results = []
    t0 = time.time()
    if "fused_logprobs" in FLAGS.kernels:
        for n, h in sizes:
            results += bench_logprobs(n, h, vocab, dtype, device, warmup, repeats)
    tokens = sorted({n for n, _ in sizes})
    for n in tokens:
        if "dis_loss" in FLAGS.kernels:
            results += bench_dis(n, row_len, device, warmup, repeats)
        if "gae" in FLAGS.kernels:
            results += bench_gae(n, row_len, device, warmup, repeats)
    import triton  # noqa: E402  (only for its version; the kernels imported it already)
    report = {
        "benchmark": "kernels",
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "dtype": FLAGS.dtype,
        "smoke": FLAGS.smoke, "interpreter": K.interpreter_enabled(),
        "peak_bf16_tflops": PEAK_BF16_TFLOPS, "peak_hbm_tbps": PEAK_HBM_TBPS,
        "peaks_note": "vendor datasheet: H100/H200 SXM dense bf16 989 TFLOP/s; H200 HBM3e "
                      "4.8 TB/s",
        "measured_matmul_tflops": matmul_ceiling_tflops(),
        "targets": {"fused_logprobs_speedup": 1.5, "fused_logprobs_memory_ratio": 4.0,
                    "gae_speedup_vs_torch_loop": 20.0},
        "seconds": time.time() - t0,
        "results": results,
        "summary": summarize(results),
    }
    print_table(results)
    for s in report["summary"]:
        print("summary:", json.dumps(s))
    line = json.dumps(report)
    if FLAGS.out_json:
        with open(FLAGS.out_json, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    app.run(main)

"""Kernels (sao_actor_learner.kernels) against the torch references, values and gradients.

Triton runs on CPU through its interpreter: TRITON_INTERPRET=1 must be in the environment before
triton is first imported in the process, so this module sets it (setdefault, and only if triton
is not imported yet) before anything else; on a CUDA machine it leaves the interpreter off and
the Triton tests run compiled kernels on the GPU. If another module imported triton earlier
without the interpreter (and there is no GPU), the in-process Triton tests skip and
`test_triton_suite_in_fresh_process` reruns this file in a fresh interpreter instead.

Tolerances (the reference is the materialised fp64 computation unless said otherwise):
- fused_logprobs, fp32 inputs: logp and entropy max abs error <= 5e-5; grads relative
  Frobenius error <= 1e-4.
- fused_logprobs, bf16 inputs (both paths accumulate in fp32): logp and entropy max abs error
  <= 2e-3 on CPU; grads relative Frobenius error <= 2e-2 (the Triton backward keeps the logit
  gradient in bf16, as eager PyTorch does, and returns bf16 grads).
- dis_loss: loss, stats and gradients within rel 1e-5 / abs 1e-6 of
  learner.losses.dis_policy_loss.
- skip_observation_gae: within 1e-5 abs + 1e-5 rel of learner.advantages (the scan adds in
  another order than the reference's loop).
"""
import os
import sys

import torch  # does not import triton

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import json  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

from sao_actor_learner import kernels as K  # noqa: E402
from sao_actor_learner.kernels import dispatch  # noqa: E402
from sao_actor_learner.learner import advantages as ref_adv  # noqa: E402
from sao_actor_learner.learner import losses as ref_losses  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available() and not dispatch.interpreter_enabled()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TRITON_OK = dispatch.triton_available(DEVICE)
needs_triton = pytest.mark.skipif(
    not TRITON_OK, reason="Triton cannot run in this process (not installed, or imported before "
    "TRITON_INTERPRET was set: see test_triton_suite_in_fresh_process)")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=180)


# ----------------------------------------------------------------------------- fused_logprobs


def _reference_logprobs(hidden, weight, targets, temperature):
    """Materialised fp64 logits: (logp, entropy) with autograd."""
    z = (hidden.double() @ weight.double().t()) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _inputs(shape, V, H, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * (2.0 / H ** 0.5)  # peaked-ish softmax
    targets = torch.randint(0, V, shape, generator=gen)
    return (hidden.to(DEVICE, dtype).requires_grad_(), weight.to(DEVICE, dtype).requires_grad_(),
            targets.to(DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_logprobs_values_and_grads(backend, dtype):
    # V=100 is not a multiple of the vocabulary tile (32 in the interpreter, 128 on CUDA), H=40
    # not a multiple of BLOCK_H, N=3*13 not a multiple of BLOCK_N; leading dims are kept.
    V, H, temperature = 100, 40, 0.7
    hidden, weight, targets = _inputs((3, 13), V, H, dtype)
    gen = torch.Generator().manual_seed(1)
    g_lp = torch.randn(3, 13, generator=gen, dtype=torch.float64).to(DEVICE)
    g_ent = torch.randn(3, 13, generator=gen, dtype=torch.float64).to(DEVICE)
    lp_ref, ent_ref = _reference_logprobs(hidden, weight, targets, temperature)
    gh_ref, gw_ref = torch.autograd.grad((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum(),
                                         (hidden, weight))
    # Small chunks: the torch path runs 3 chunks of 16 rows, the Triton backward 4 vocabulary
    # slices of 32 (the last one 4 wide) and the forward splits the vocabulary in 2.
    chunk = 1600 if backend == "torch" else 39 * 32
    lp, ent = K.fused_logprobs(hidden, weight, targets, temperature=temperature,
                               return_entropy=True, backend=backend, chunk_size=chunk)
    assert lp.shape == (3, 13) and ent.shape == (3, 13) and lp.dtype == torch.float32
    gh, gw = torch.autograd.grad((lp * g_lp.float()).sum() + (ent * g_ent.float()).sum(),
                                 (hidden, weight))
    assert gh.dtype == dtype and gw.dtype == dtype
    val_tol, grad_tol = (5e-5, 1e-4) if dtype == torch.float32 else (2e-3, 2e-2)
    assert (lp.double() - lp_ref).abs().max().item() <= val_tol
    assert (ent.double() - ent_ref).abs().max().item() <= val_tol
    assert _rel(gh, gh_ref) <= grad_tol
    assert _rel(gw, gw_ref) <= grad_tol


@needs_triton
def test_fused_logprobs_triton_partial_grads():
    """Only logp used, only the entropy used, and a frozen LM head (no grad_weight)."""
    V, H = 70, 24
    hidden, weight, targets = _inputs((20,), V, H, torch.float32, seed=3)
    for which in (0, 1):  # 0: logp alone (no entropy asked for); 1: the entropy alone
        ref = _reference_logprobs(hidden, weight, targets, 1.0)[which]
        mine = (K.fused_logprobs(hidden, weight, targets, backend="triton") if which == 0 else
                K.fused_logprobs(hidden, weight, targets, backend="triton", return_entropy=True)[1])
        assert (mine.double() - ref).abs().max().item() <= 5e-5
        gh, gw = torch.autograd.grad(mine.sum(), (hidden, weight))
        gh_ref, gw_ref = torch.autograd.grad(ref.sum(), (hidden, weight))
        assert _rel(gh, gh_ref) <= 1e-4 and _rel(gw, gw_ref) <= 1e-4
    frozen = weight.detach()
    lp = K.fused_logprobs(hidden, frozen, targets, backend="triton")
    (gh,) = torch.autograd.grad(lp.sum(), (hidden,))
    (gh_ref,) = torch.autograd.grad(_reference_logprobs(hidden, frozen, targets, 1.0)[0].sum(),
                                    (hidden,))
    assert _rel(gh, gh_ref) <= 1e-4


@needs_triton
def test_fused_logprobs_triton_out_of_range_target_is_nan():
    hidden, weight, _ = _inputs((4,), 50, 16, torch.float32)
    targets = torch.tensor([0, 49, 50, -1], device=DEVICE)
    with torch.no_grad():
        lp = K.fused_logprobs(hidden, weight, targets, backend="triton")
    assert torch.isfinite(lp[:2]).all() and torch.isnan(lp[2:]).all()


def test_fused_logprobs_torch_gradcheck_fp64():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(7, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 7, (5,), generator=gen)

    def f(h, w):
        lp, ent = K.fused_logprobs(h, w, targets, temperature=1.3, return_entropy=True,
                                   backend="torch", chunk_size=14)
        return lp, ent
    assert torch.autograd.gradcheck(f, (hidden, weight))


def test_fused_logprobs_matches_token_logprobs():
    """The causal-LM alignment the learner uses: hidden[:, :-1] predicts tokens[:, 1:]."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 9, 16, generator=gen)
    weight = torch.randn(30, 16, generator=gen)
    tokens = torch.randint(0, 30, (2, 9), generator=gen)
    expected = ref_losses.token_logprobs(hidden @ weight.t(), tokens, temperature=0.8)[:, 1:]
    got = K.fused_logprobs(hidden[:, :-1], weight, tokens[:, 1:], temperature=0.8)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_fused_logprobs_argument_errors():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="targets"):
        K.fused_logprobs(h, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="lm_head_weight"):
        K.fused_logprobs(h, torch.randn(10, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        K.fused_logprobs(h, w, torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="backend"):
        K.fused_logprobs(h, w, torch.zeros(4, dtype=torch.long), backend="cuda")


@needs_cuda
def test_fused_logprobs_cuda_medium_bf16():
    """Several tiles, splits and vocabulary slices with the CUDA tile sizes (GPU only)."""
    V, H = 5003, 256
    hidden, weight, targets = _inputs((1000,), V, H, torch.bfloat16, seed=5)
    g = torch.randn(1000, device=DEVICE)
    outs = {}
    for backend, chunk in (("torch", None), ("triton", 1000 * 1024)):
        lp, ent = K.fused_logprobs(hidden, weight, targets, return_entropy=True, backend=backend,
                                   chunk_size=chunk)
        gh, gw = torch.autograd.grad((lp * g).sum() + ent.sum(), (hidden, weight))
        outs[backend] = (lp, ent, gh, gw)
    lp0, ent0, gh0, gw0 = outs["torch"]
    lp1, ent1, gh1, gw1 = outs["triton"]
    assert (lp0 - lp1).abs().max().item() <= 2e-3
    assert (ent0 - ent1).abs().max().item() <= 2e-3
    assert _rel(gh1, gh0) <= 2e-2 and _rel(gw1, gw0) <= 2e-2


# ----------------------------------------------------------------------------- dis_loss


def _dis_inputs(mask_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, T = 5, 29
    logp = -torch.rand(B, T, generator=gen) * 4
    rollout = logp + 0.4 * torch.randn(B, T, generator=gen)
    rollout[0, 3] = logp[0, 3] + 25.0  # log-ratio beyond the clamp (-20)
    rollout[1, 4] = logp[1, 4] - 30.0  # and beyond +20
    adv = torch.randn(B, T, generator=gen)
    lengths = torch.tensor([29, 17, 0, 8, 23])  # ragged; row 2 has no action tokens
    pos = torch.arange(T)
    mask = (pos[None] < lengths[:, None]) & (pos[None] >= 2) & ((pos[None] % 7) != 5)
    mask = mask.to(mask_dtype)
    return (logp.to(DEVICE).requires_grad_(), rollout.to(DEVICE).requires_grad_(),
            adv.to(DEVICE), mask.to(DEVICE))


def _compare_dis(got, expected):
    (loss, stats), (loss_ref, stats_ref) = got, expected
    assert set(stats) == set(stats_ref)
    for k in stats_ref:
        assert stats[k] == pytest.approx(stats_ref[k], rel=1e-5, abs=1e-6), k
    torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalization", ["action_tokens", "kept_tokens"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_dis_loss_matches_reference(backend, normalization, mask_dtype):
    logp, rollout, adv, mask = _dis_inputs(mask_dtype)
    expected = ref_losses.dis_policy_loss(logp, rollout, adv, mask, 0.3, 0.5, normalization)
    g_ref = torch.autograd.grad(expected[0], (logp, rollout))
    got = K.dis_loss(logp, rollout, adv, mask, 0.3, 0.5, normalization, backend=backend)
    _compare_dis(got, expected)
    g = torch.autograd.grad(got[0], (logp, rollout))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dis_loss_no_action_tokens(backend):
    logp, rollout, adv, mask = _dis_inputs(torch.bool)
    mask = torch.zeros_like(mask)
    expected = ref_losses.dis_policy_loss(logp, rollout, adv, mask, 0.3, 5.0)
    got = K.dis_loss(logp, rollout, adv, mask, 0.3, 5.0, backend=backend)
    _compare_dis(got, expected)
    assert got[1]["ratio_mean"] == 1.0 and got[1]["num_action_tokens"] == 0.0
    (g,) = torch.autograd.grad(got[0], (logp,))
    assert torch.count_nonzero(g) == 0


def test_dis_loss_bad_normalization():
    logp, rollout, adv, mask = _dis_inputs(torch.bool)
    with pytest.raises(ValueError, match="normalization"):
        K.dis_loss(logp, rollout, adv, mask, 0.3, 5.0, normalization="tokens")


# ----------------------------------------------------------------------------- GAE


def _gae_inputs(B=6, T=53, seed=0, mask_dtype=torch.bool):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=gen)
    values = torch.randn(B, T, generator=gen)
    pos = torch.arange(T)
    # Prompt, then turns: 9 action tokens, 4 observation tokens; ragged ends.
    ends = (torch.tensor([1.0, 0.75, 0.0, 0.4, 0.3, 1.0]) * T).long()[torch.arange(B) % 6]
    mask = (pos[None] >= 5) & (pos[None] < ends[:, None]) & ((pos[None] - 5) % 13 < 9)
    mask[2] = False  # no action tokens at all
    mask[B - 2] = False
    mask[B - 2, T // 3] = True  # a single action token
    mask[B - 1, 0] = True  # an action token at position 0
    mask[B - 1, T - 1] = True  # and at the last position
    return rewards.to(DEVICE), values.to(DEVICE), mask.to(mask_dtype).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("lam_kind", ["float", "rows", "rows+bootstrap"])
def test_gae_matches_reference(backend, mask_dtype, lam_kind):
    # T=53 spans 4 tiles of 16 in the interpreter (the first one partial).
    rewards, values, mask = _gae_inputs(mask_dtype=mask_dtype)
    B = values.shape[0]
    gen = torch.Generator().manual_seed(9)
    lam = 0.95 if lam_kind == "float" else torch.rand(B, generator=gen).to(DEVICE)
    boot = torch.randn(B, generator=gen).to(DEVICE) if lam_kind == "rows+bootstrap" else None
    adv_ref, ret_ref = ref_adv.skip_observation_gae(rewards, values, mask, 0.99, lam, boot)
    adv, ret = K.skip_observation_gae(rewards, values, mask, 0.99, lam, boot, backend=backend)
    torch.testing.assert_close(adv, adv_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ret_ref, rtol=1e-5, atol=1e-5)
    assert (adv[2] == 0).all() and (ret[2] == 0).all()


@needs_triton
def test_gae_long_row_and_lambda_one():
    """gamma = lambda = 1 (Monte-Carlo returns): the scan's sums over a long row stay exact-ish."""
    rewards, values, mask = _gae_inputs(B=4, T=300, seed=2)
    adv_ref, ret_ref = ref_adv.skip_observation_gae(rewards, values, mask, 1.0, 1.0)
    adv, ret = K.skip_observation_gae(rewards, values, mask, 1.0, 1.0, backend="triton")
    torch.testing.assert_close(adv, adv_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ret_ref, rtol=1e-5, atol=1e-5)


def test_gae_shape_errors():
    r, v, m = _gae_inputs()
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        K.skip_observation_gae(r[:, :-1], v, m, 1.0, 0.9)
    with pytest.raises(ValueError, match="lambda"):
        K.skip_observation_gae(r, v, m, 1.0, torch.ones(2, device=DEVICE), backend="torch")


# ----------------------------------------------------------------------------- dispatch


def test_auto_picks_torch_on_cpu_and_for_float64():
    cpu = torch.zeros(3)
    assert dispatch.resolve_backend("auto", "op", (cpu,)) == "torch"
    assert dispatch.resolve_backend("torch", "op", (cpu,)) == "torch"
    if torch.cuda.is_available():
        assert dispatch.resolve_backend("auto", "op", (cpu.double().cuda(),)) == "torch"
    with pytest.raises(ValueError, match="must be one of"):
        dispatch.resolve_backend("gpu", "op", (cpu,))


def test_package_imports_without_triton_or_heavy_deps():
    """No triton installed: the package imports, auto/torch run, triton fails clearly."""
    code = r"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError("No module named 'triton' (blocked by the test)")
sys.meta_path.insert(0, Block())
import torch
import sao_actor_learner.kernels as K
assert not K.triton_available()
h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
K.fused_logprobs(h, w, y)
r, m = torch.randn(2, 5), torch.ones(2, 5, dtype=torch.bool)
K.skip_observation_gae(r, r, m, 1.0, 0.9)
try:
    K.fused_logprobs(h, w, y, backend="triton")
except RuntimeError as e:
    assert "not installed" in str(e), e
else:
    raise AssertionError("backend='triton' ran without triton")
heavy = [m for m in ("triton", "reverb", "tensorflow", "grpc") if m in sys.modules]
assert not heavy, heavy
print("OK")
"""
    res = _run(code)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_triton_backend_error_without_interpreter():
    """No CUDA and no TRITON_INTERPRET: backend='triton' says what to set, for every kernel."""
    code = r"""
import torch
import sao_actor_learner.kernels as K
h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
r, m = torch.randn(2, 5), torch.ones(2, 5, dtype=torch.bool)
calls = [lambda: K.fused_logprobs(h, w, y, backend="triton"),
         lambda: K.dis_loss(r, r, r, m, 0.2, 0.2, backend="triton"),
         lambda: K.skip_observation_gae(r, r, m, 1.0, 0.9, backend="triton")]
for call in calls:
    try:
        call()
    except RuntimeError as e:
        assert "TRITON_INTERPRET=1" in str(e) and "CUDA" in str(e), e
    else:
        raise AssertionError("backend='triton' ran on CPU without the interpreter")
assert K.dis_loss(r, r, r, m, 0.2, 0.2)[1]["num_action_tokens"] == 10.0  # auto -> torch
print("OK")
"""
    env = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"}
    res = _run(code, **env)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.skipif(TRITON_OK or not dispatch.triton_importable() or torch.cuda.is_available(),
                    reason="the Triton tests run in this process")
def test_triton_suite_in_fresh_process():
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
         "-k", "not fresh_process and not benchmark"],
        cwd=ROOT, env=_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:]
    assert "passed" in res.stdout.strip().splitlines()[-1], res.stdout[-2000:]


@pytest.mark.skipif(not dispatch.triton_importable(), reason="triton is not installed")
def test_benchmark_smoke():
    env = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "programs/benchmarks/kernels.py", "--smoke"],
                         cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    kernels = {(r["kernel"], r["impl"]) for r in report["results"] if r["status"] == "ok"}
    assert {("fused_logprobs", "triton"), ("fused_logprobs", "eager"), ("dis_loss", "triton"),
            ("dis_loss", "eager"), ("skip_observation_gae", "triton"),
            ("skip_observation_gae", "torch_loop"),
            ("skip_observation_gae", "python_loop")} <= kernels
    assert report["peak_bf16_tflops"] == 989.0 and report["summary"]

"""A synthetic ``metrics.jsonl`` shaped like a large job's, for the report's tests and benchmark.

Every train record holds what the Monitor writes with ``timing_log_option: all``, per-module
norms and straggler scores: ``timers/<t>/rank<r>`` for 3 timers x ranks (with the ``/max``,
``/min`` and ``/mean`` an ``all`` metric writes beside them), 5 norm families x
modules (``grad_norm/<module>`` ...), about 50 scalars, keys sorted as the Monitor writes them.
Eval records every 10 log steps, ``stragglers`` every 10, ``tensor_stats`` every 50; three jobs
(the second resumes before the first one's last step); a non-finite gradient with its alert,
loss and gradient spikes, skipped steps, and a few persistent straggler ranks.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

TIMERS = ("forward-backward", "optimizer", "step")
FAMILIES = ("effective_lr_ratio", "grad_norm", "param_norm", "relative_update_norm", "update_norm")
SUBMODULES = ("attn_norm", "attn.q", "attn.k", "attn.v", "attn.proj", "mlp_norm", "mlp.fc1", "mlp.fc2")
CATEGORIES = ("code", "math", "web")
TIMER_MS = {"forward-backward": 310.0, "optimizer": 42.0, "step": 380.0}


def module_names(n: int) -> list[str]:
    """``n`` module names in model order: embed, layers.<i>.<sub>..., norm, head."""
    names, layer = ["embed"], 0
    while len(names) < n - 2:
        names += [f"layers.{layer}.{sub}" for sub in SUBMODULES]
        layer += 1
    return (names[: max(n - 2, 1)] + ["norm", "head"])[:n]


def generate(path: Path, steps: int, ranks: int, modules: int, log_interval: int = 10, seed: int = 0) -> dict:
    """Write the file with about ``steps`` log steps over three jobs; returns lines, seconds, bytes."""
    job = _Job(ranks, modules, steps, log_interval, seed)
    t0 = time.perf_counter()
    lines = 0
    with open(path, "w", encoding="utf-8", buffering=1 << 22) as f:
        for index, (first, last) in enumerate(job.plan):
            lines += job.write_start(f, index, first)
            for i in range(first, last + 1):
                lines += job.write_log_step(f, index, i)
    return {"lines": lines, "gen_s": time.perf_counter() - t0, "bytes": path.stat().st_size}


class _Job:
    """The model, the ranks and the per-record values of the synthetic run."""

    def __init__(self, ranks: int, modules: int, steps: int, log_interval: int, seed: int) -> None:
        self.rng = rng = np.random.default_rng(seed)
        self.ranks, self.log_interval, self.total_steps = ranks, log_interval, steps * log_interval
        self.modules = module_names(modules)
        m = len(self.modules)
        first_end = int(steps * 0.45)
        resume = max(1, first_end - max(1, steps // 20))  # job 1 resumes before job 0's last step
        second_end = int(steps * 0.8)
        end = steps + (first_end - resume + 1)
        self.plan = [(1, first_end), (resume, second_end), (second_end + 1, end)]
        self.bad_step = first_end * 2 // 3  # a non-finite gradient in job 0
        self.spikes = set(rng.choice(np.arange(1, steps), size=max(2, steps // 400), replace=False).tolist())
        depth = np.linspace(0, 1, m)
        self.grad_base = 0.05 * np.exp(-2.5 * depth) * rng.lognormal(0, 0.4, m)
        self.param_base = 20 * rng.lognormal(0, 0.5, m)
        self.update_coef = rng.lognormal(0, 0.6, m)
        self.speed = 1 + 0.01 * rng.standard_normal(ranks)
        self.slow = rng.choice(ranks, size=max(1, ranks // 1000), replace=False)
        self.speed[self.slow] *= 1.18  # persistent stragglers
        keys = sorted(self._scalar_names() + [f"{f}/{mod}" for f in FAMILIES for mod in self.modules]
                      + [f"timers/{t}/rank{r}" for t in TIMERS for r in range(ranks)])
        position = {k: i for i, k in enumerate(keys)}
        self.keys = keys
        self.family_index = {f: np.array([position[f"{f}/{mod}"] for mod in self.modules]) for f in FAMILIES}
        self.timer_index = {t: np.array([position[f"timers/{t}/rank{r}"] for r in range(ranks)]) for t in TIMERS}
        self.scalar_index = np.array([position[k] for k in self._scalar_names()])
        head = '{"kind": "train", "step": %d, "time": "%s"'
        self.template = head + "".join(f", {json.dumps(k)}: %.17g" for k in keys) + \
            ', "stragglers/score_min_host": "%s"}\n'

    def _scalar_names(self) -> list[str]:
        return ["train/loss", "train/lr", "train/tokens_per_sec", "train/tokens_per_sec_per_gpu",
                "train/tflops_per_gpu", "train/mfu_pct", "train/sol_pct", "train/eta_s", "train/step_time_ms",
                "train/consumed_tokens", "grad_norm", "grad_clip_ratio", "param_norm", "update_norm",
                "relative_update_norm", "effective_lr_ratio", "grad_nonfinite", "grad_missing_params",
                "health/loss_spike", "health/grad_spike", "health/loss_spike_factor", "health/grad_spike_factor",
                "health/nonfinite_loss", "health/skipped_steps", "memory/allocated_gib", "memory/max_allocated_gib",
                "memory/reserved_gib", "memory/host_rss_gib", "memory/alloc_retries", "memory/ooms",
                "memory/max_allocated_gib/max_rank", "power/mean_w", "power/max_w", "power/min_w", "power/max_w_rank",
                "energy/total_j", "energy/j_per_token", "energy/j_per_gpu_per_step", "gpu/temperature_c/max",
                "gpu/temperature_c/min", "moe/load_imbalance", "stragglers/score_min", "stragglers/score_min_rank",
                "stragglers/score_min_local_rank"] + [f"train/loss/{c}" for c in CATEGORIES] \
            + [f"stragglers/{t}/{k}" for t in TIMERS for k in ("rank", "local_rank", "max_over_median", "score_min",
                                                                "score_min_rank")] \
            + [f"timers/{t}/{k}" for t in TIMERS for k in ("max", "mean", "min")]

    def write_start(self, f, index: int, first: int) -> int:
        """The job's run record and its gpu_model record."""
        hosts = [f"node-{r // 8:04d}" for r in range(self.ranks)]
        run = {"kind": "run", "step": (first - 1) * self.log_interval, "time": f"2026-01-0{index + 1}T00:00:00+00:00",
               "world_size": self.ranks, "writer_rank": 0, "hosts": sorted(set(hosts)),
               "ranks": [{"rank": r, "host": hosts[r], "local_rank": r % 8} for r in range(self.ranks)],
               "modules": ["model"] + self.modules, "job_id": str(1000 + index), "layout": "device_mesh",
               "torch_version": "2.13.0", "distmetrics_version": "0.1.0", "python_version": "3.11", "argv": [],
               "config": {}}
        gpus = {"kind": "gpu_model", "step": 0, "time": "t",
                "ranks": [{"rank": r, "name": "NVIDIA H100 80GB HBM3"} for r in range(min(self.ranks, 64))]}
        f.write(json.dumps(run) + "\n" + json.dumps(gpus) + "\n")
        return 2

    def write_log_step(self, f, index: int, i: int) -> int:
        """Log step ``i``: its train record and, on some steps, alert, eval, stragglers, tensor_stats."""
        step = i * self.log_interval
        stamp = f"2026-01-0{index + 1}T{(i // 3600) % 24:02d}:{(i // 60) % 60:02d}:{i % 60:02d}+00:00"
        values, loss, timers = self._values(i, index == 0 and i == self.bad_step)
        lines = 1
        if np.isfinite(values).all():
            f.write(self.template % ((step, stamp) + tuple(values.tolist()) + ("node-0042",)))
        else:
            record = {"kind": "train", "step": step, "time": stamp}
            record.update({k: (v if math.isfinite(v) else "NaN") for k, v in zip(self.keys, values.tolist())})
            f.write(json.dumps(record) + "\n")
            first = self.modules[len(self.modules) // 3]
            f.write(json.dumps({"kind": "alert", "step": step, "time": stamp, "alert": "nonfinite_grad",
                                "message": f"non-finite gradient first in module {first!r}", "first_module": first})
                    + "\n")
            lines += 1
        if i % 10 == 0:
            f.write(json.dumps(self._eval(step, stamp, loss)) + "\n")
            f.write(json.dumps(self._stragglers(step, stamp, timers["step"])) + "\n")
            lines += 2
        if i % 50 == 0:
            f.write(json.dumps(self._tensor_stats(step, stamp)) + "\n")
            lines += 1
        return lines

    def _values(self, i: int, bad: bool):
        rng, m = self.rng, len(self.modules)
        progress = min(i * self.log_interval / self.total_steps, 1.0)
        lr = 3e-4 * min(1.0, progress * 20) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        grad = self.grad_base * (1 + 2 * math.exp(-8 * progress)) * rng.lognormal(0, 0.15, m)
        param = self.param_base * (1 + 0.3 * progress)
        update = param * lr * 5 * self.update_coef * rng.lognormal(0, 0.1, m)
        spike = i in self.spikes
        if spike:
            grad[: m // 10] *= 20
        v = np.empty(len(self.keys))
        for family, values in (("grad_norm", grad), ("param_norm", param), ("update_norm", update),
                               ("relative_update_norm", update / param),
                               ("effective_lr_ratio", update / (grad * lr * 1e3 + 1e-12))):
            v[self.family_index[family]] = values
        timers = {}
        for t in TIMERS:
            ms = TIMER_MS[t] * self.speed * (1 + 0.02 * rng.standard_normal(self.ranks))
            if i % 97 == 0:
                ms[rng.integers(self.ranks)] *= 2.5  # a passing hiccup
            v[self.timer_index[t]] = timers[t] = ms
        loss = 2.0 + 6.0 * math.exp(-5 * progress) + 0.03 * rng.standard_normal() + (1.5 if spike else 0)
        scalars = self._scalars(i, loss, lr, grad, param, update, timers, spike)
        if bad:
            for at in (m // 3, m // 3 + 1):
                v[self.family_index["grad_norm"][at]] = v[self.family_index["effective_lr_ratio"][at]] = math.nan
            scalars.update({"grad_norm": math.nan, "grad_clip_ratio": math.nan, "grad_nonfinite": 2.0})
        v[self.scalar_index] = [scalars[k] for k in self._scalar_names()]
        return v, loss, timers

    def _scalars(self, i, loss, lr, grad, param, update, timers, spike) -> dict:
        step_ms = float(np.max(timers["step"]))
        g, p, u = (float(np.sqrt(np.sum(x ** 2))) for x in (grad, param, update))
        score = timers["step"].min() / timers["step"]
        out = {"train/loss": loss, "train/lr": lr, "train/tokens_per_sec": 4.0e6 / (step_ms / 1000),
               "train/tokens_per_sec_per_gpu": 4.0e6 / (step_ms / 1000) / self.ranks,
               "train/tflops_per_gpu": 410 * 380 / step_ms, "train/mfu_pct": 41.4 * 380 / step_ms,
               "train/sol_pct": 58.0 * 380 / step_ms, "train/eta_s": (self.total_steps - i * self.log_interval)
               * step_ms / 1000, "train/step_time_ms": step_ms, "train/consumed_tokens": i * 4e7,
               "grad_norm": g, "grad_clip_ratio": g, "param_norm": p, "update_norm": u, "relative_update_norm": u / p,
               "effective_lr_ratio": u / (g * lr * 1e3), "grad_nonfinite": 0.0, "grad_missing_params": 0.0,
               "health/loss_spike": float(spike), "health/grad_spike": float(spike),
               "health/loss_spike_factor": 1.6 if spike else 1.0, "health/grad_spike_factor": 14.0 if spike else 1.0,
               "health/nonfinite_loss": 0.0, "health/skipped_steps": 1.0 if i % 1111 == 0 else 0.0,
               "memory/allocated_gib": 51 + 0.5 * math.sin(i / 50), "memory/max_allocated_gib": 66.0,
               "memory/reserved_gib": 70.0, "memory/host_rss_gib": 18.0, "memory/alloc_retries": float(i // 3000),
               "memory/ooms": 0.0, "memory/max_allocated_gib/max_rank": float(self.slow[0]),
               "power/mean_w": 620 + 20 * self.rng.standard_normal(), "power/max_w": 700.0, "power/min_w": 540.0,
               "power/max_w_rank": 7.0, "energy/total_j": 620.0 * self.ranks * step_ms / 100,
               "energy/j_per_token": 620.0 * self.ranks * step_ms / 1000 / 4e6,
               "energy/j_per_gpu_per_step": 620 * step_ms / 1000, "gpu/temperature_c/max": 78.0,
               "gpu/temperature_c/min": 61.0, "moe/load_imbalance": 1.1 + 0.05 * self.rng.random(),
               "stragglers/score_min": float(score.min()), "stragglers/score_min_rank": float(np.argmin(score)),
               "stragglers/score_min_local_rank": float(np.argmin(score) % 8)}
        out.update({f"train/loss/{c}": loss + 0.3 * (k - 1) for k, c in enumerate(CATEGORIES)})
        for t in TIMERS:
            ms = timers[t]
            out.update({f"timers/{t}/max": float(ms.max()), f"timers/{t}/mean": float(ms.mean()),
                        f"timers/{t}/min": float(ms.min())})
            out.update({f"stragglers/{t}/rank": float(np.argmax(ms)),
                        f"stragglers/{t}/local_rank": float(np.argmax(ms) % 8),
                        f"stragglers/{t}/max_over_median": float(ms.max() / np.median(ms)),
                        f"stragglers/{t}/score_min": float(ms.min() / ms.max()),
                        f"stragglers/{t}/score_min_rank": float(np.argmax(ms))})
        return out

    def _eval(self, step: int, stamp: str, loss: float) -> dict:
        record = {"kind": "eval", "step": step, "time": stamp, "eval/loss": loss + 0.05,
                  "eval/ppl": math.exp(loss + 0.05), "eval/gap": 0.05 + 0.01 * self.rng.standard_normal(),
                  "eval/time_ms": 5000.0, "eval/tokens_per_sec": 8.0e6}
        record.update({f"eval/loss/{c}": loss + 0.05 + 0.3 * (k - 1) for k, c in enumerate(CATEGORIES)})
        return record

    def _stragglers(self, step: int, stamp: str, step_ms: np.ndarray) -> dict:
        score = step_ms.min() / step_ms
        order = np.argsort(score, kind="stable")

        def row(r: int) -> dict:
            return {"rank": int(r), "host": f"node-{r // 8:04d}", "local_rank": int(r % 8), "score": float(score[r]),
                    "ms": float(step_ms[r]), "power_w": 690.0 - 80.0 * float(r in self.slow),
                    "sm_clock_mhz": 1980.0 - 400.0 * float(r in self.slow)}
        return {"kind": "stragglers", "step": step, "time": stamp, "window": 10, "threshold": 0.9,
                "slowest": [row(r) for r in order[:8]], "fastest": [row(r) for r in order[::-1][:8]], "timers": {}}

    def _tensor_stats(self, step: int, stamp: str) -> dict:
        record = {"kind": "tensor_stats", "step": step, "time": stamp}
        layers = sorted({m.rsplit(".", 1)[0] for m in self.modules if m.endswith("mlp.fc1")})[:256]
        for k, layer in enumerate(layers):
            for tensor in ("activation", "gradient"):
                scale = (1 + k / 50) * (1e-3 if tensor == "gradient" else 1)
                record[f"tensor_stats/{layer}/{tensor}/max"] = scale * (4 + self.rng.random())
                record[f"tensor_stats/{layer}/{tensor}/std"] = scale * (0.5 + 0.1 * self.rng.random())
        return dict(sorted(record.items()))

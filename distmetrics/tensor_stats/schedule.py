"""Which steps and tensors a features file selects, read from the YAML alone (every rank reads the
same file, so every rank agrees without a collective), with each namespace's own convention:
nvdlfw-inspect's ``enable_logging_at_current_step`` for our features and its base ones,
TransformerEngine's inclusive ends for TE's."""

from __future__ import annotations

from typing import Any

__all__ = ["stats_step", "selected_tensors", "enabled_features", "logs_at", "tensor_names"]


def stats_step(spec: dict, iteration: int, hooked_only: bool = False) -> bool:
    """Does any enabled feature log at this iteration? ``hooked_only``: only the features our
    module hooks call (our namespace and nvdlfw's base ``LogTensorStats``); otherwise also TE's."""
    return any(logs_at(namespace, dict(cfg, **entry), iteration) for body in spec.values()
               for namespace, cfg in enabled_features(body, hooked_only)
               for entry in first_entries(cfg.get("tensors_struct")) or [cfg])


def selected_tensors(body: dict, iteration: int) -> list:
    """The tensor names a section's enabled features select at ``iteration`` (each tensor's first
    ``tensors_struct`` entry, as nvdlfw-inspect reads them), each once, in the file's order."""
    names: dict = {}
    for namespace, cfg in enabled_features(body, hooked_only=False):
        struct = first_entries(cfg.get("tensors_struct"))
        for entry in struct or [cfg]:
            if logs_at(namespace, dict(cfg, **entry), iteration):
                names.update(dict.fromkeys([entry.get("tensor")] if struct else cfg.get("tensors") or ()))
    return [name for name in names if name is not None]


def enabled_features(body: dict, hooked_only: bool) -> list:
    """(namespace, settings) of an enabled section's enabled logging features: those our hooks call,
    and TE's unless ``hooked_only``. TE's are those whose name starts with ``Log`` (LogTensorStats,
    LogFp8TensorStats): its others (DisableFP8GEMM, PerTensorScaling, ...) log nothing, and have no
    ``freq``, so counted here they would make every step a statistics step, each with an all-gather."""
    if not body.get("enabled"):
        return []
    features = [("distmetrics", (body.get("distmetrics") or {}).get("LogTensorStats")),
                ("base", body.get("LogTensorStats"))]
    if not hooked_only:
        features += [("transformer_engine", cfg) for name, cfg in (body.get("transformer_engine") or {}).items()
                     if isinstance(name, str) and name.startswith("Log")]
    return [(namespace, cfg) for namespace, cfg in features if isinstance(cfg, dict) and cfg.get("enabled")]


def first_entries(struct: Any) -> list:
    """A ``tensors_struct``'s entries, each tensor's first only: the one nvdlfw-inspect reads (a
    later entry's schedule gathered values at steps that then brought none, and a warning)."""
    first: dict = {}
    for entry in struct or ():
        first.setdefault(entry.get("tensor"), entry)
    return list(first.values())


def logs_at(namespace: str, cfg: dict, iteration: int) -> bool:
    """A feature entry's freq/start_step/end_step/start_end_list at ``iteration``, with the
    namespace's own convention (TE's ends are inclusive, nvdlfw's end_step -1 is open)."""
    freq = int(cfg.get("freq", 1))
    if namespace == "transformer_engine":  # an end of -1: no end in TE versions on nvdlfw-inspect's schedule,
        # nothing in those on next_enabled_iter: gathered as no end (a step TE logs nothing at gathers nothing)
        intervals = cfg.get("start_end_list") or [(cfg.get("start_step") or 0, cfg.get("end_step"))]
        return iteration % freq == 0 and any(s <= iteration and (e is None or e == -1 or iteration <= e)
                                             for s, e in intervals)
    from nvdlfw_inspect.logging import enable_logging_at_current_step

    return enable_logging_at_current_step(iteration, freq, cfg.get("start_step", 0), cfg.get("end_step", -1),
                                          cfg.get("start_end_list"))


def tensor_names(spec: dict) -> set:
    """Every tensor name a features file gives (``tensors`` lists, ``tensors_struct`` entries) in any
    namespace; TE's and nvdlfw-inspect's features read nothing else."""
    names: set = set()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            tensors, struct = node.get("tensors"), node.get("tensors_struct")
            if isinstance(tensors, list):
                names.update(t for t in tensors if isinstance(t, str))
            for entry in struct if isinstance(struct, list) else ():
                if isinstance(entry, dict) and isinstance(entry.get("tensor"), str):
                    names.add(entry["tensor"])
            for value in node.values():
                visit(value)

    visit(spec)
    return names

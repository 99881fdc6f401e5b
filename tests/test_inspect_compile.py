"""Tensor statistics of a model that torch.compile runs (Dynamo, backend aot_eager, on CPU), on real
gloo ranks, compared with an eager copy of the model measured in float64: blocks compiled one by one
(torchtitan's way), code compiled before the Monitor was made, a compiled block selected itself, and
``fullgraph=True``."""

import re

import pytest

from tests.dist_utils import run_ranks

STATS = ["max", "std", "l1_norm"]
BLOCKS = 3


def _features(regex: str) -> dict:
    return {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": regex},
                  "distmetrics": {"LogTensorStats": {"enabled": True, "tensors_struct": [
                      {"tensor": "activation", "stats": STATS, "freq": 1},
                      {"tensor": "gradient", "stats": STATS, "freq": 1}]}}}}


def _net(blocks: int = BLOCKS):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 8)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.layers = nn.ModuleList(Block() for _ in range(blocks))
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            x = self.inp(x)
            for block in self.layers:
                x = block(x)
            return self.head(x).pow(2).mean()

    torch.manual_seed(0)
    return Net()


def _compile_blocks(model, how: str, **options) -> None:
    import torch

    for i in range(BLOCKS):
        if how == "torch.compile(block)":
            model.layers[i] = torch.compile(model.layers[i], backend="aot_eager", **options)
        else:
            model.layers[i].compile(backend="aot_eager", **options)


def _truth(reference, module, inputs) -> dict:
    """Statistics of ``module`` (a layer of the eager ``reference``) over ``inputs``' steps, in float64."""
    captured: dict = {}

    def spy(mod, args, output):
        captured["activation"] = output.detach().double()
        output.register_hook(lambda grad: captured.__setitem__("gradient", grad.detach().double()))

    handle = module.register_forward_hook(spy)
    truth = {}
    for step, x in enumerate(inputs, start=1):
        reference(x).backward()
        for tensor, t in captured.items():
            values = {"max": t.max(), "std": t.std(), "l1_norm": t.abs().sum()}
            truth.update({f"{step}/{tensor}/{stat}": float(v) for stat, v in values.items()})
    handle.remove()
    assert len(truth) == 2 * len(inputs) * len(STATS)
    return truth


def _measured(root: str, case: str, model, regex: str, inputs, warm_up: bool = False) -> dict:
    """The statistics the Monitor writes for ``model`` (its layer names kept), by step/tensor/stat."""
    import torch

    import distmetrics as dm

    if warm_up:  # a compile warm-up with grad, before the Monitor and its hooks exist
        model(inputs[0]).backward()
    out = f"{root}/{re.sub(r'[^a-z]+', '_', case)}"
    cfg = dm.MetricsConfig(output_dir=out, log_interval=1, console=False, tensorboard=False, log_progress=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": _features(regex)})
    with dm.Monitor(cfg, model=model) as monitor:
        guarded = not torch._dynamo.config.skip_nnmodule_hook_guards
        for step, x in enumerate(inputs, start=1):
            model(x).backward()
            monitor.step(step)
    got = {}
    for record in dm.read_jsonl(f"{out}/metrics.jsonl"):
        if record["kind"] == "tensor_stats":
            for key, value in record.items():
                if key.startswith("tensor_stats/"):
                    layer, tensor, stat = key[len("tensor_stats/"):].rsplit("/", 2)
                    got[f"{layer}|{record['step']}/{tensor}/{stat}"] = value
    return {"got": got, "guarded while on": guarded,
            "restored at close": torch._dynamo.config.skip_nnmodule_hook_guards}


def _compiled_runs(rank: int, world: int, root: str) -> dict:
    import copy
    import logging

    import torch
    import torch._dynamo

    import distmetrics as dm

    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("distmetrics").addHandler(handler)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(4, 8, generator=generator) for _ in range(2)]
    results = {}
    fc1, block = r"layers\.1\.(_orig_mod\.)?fc1$", r"^model\.layers\.1(\._orig_mod)?$"  # either naming selects
    cases = [("torch.compile(block)", False, fc1, "layers.1.fc1"), ("block.compile()", False, fc1, "layers.1.fc1"),
             ("torch.compile(block)", True, fc1, "layers.1.fc1"), ("block.compile()", True, fc1, "layers.1.fc1"),
             ("torch.compile(block)", False, block, "layers.1")]
    for how, warm_up, regex, layer in cases:
        torch._dynamo.reset()
        model = _net()
        reference = copy.deepcopy(model)
        truth = _truth(reference, reference.get_submodule(layer), inputs)
        _compile_blocks(model, how)
        case = f"{how}, {'warm-up' if warm_up else 'no warm-up'}, {layer}"
        del said[:]
        results[case] = {"truth": {f"{layer}|{k}": v for k, v in truth.items()},
                         **_measured(root, case, model, regex, inputs, warm_up),
                         "said": [m for m in said if "skip_nnmodule_hook_guards" in m]}
    model = _net()
    _compile_blocks(model, "torch.compile(block)")
    cfg = dm.MetricsConfig(output_dir=f"{root}/none", console=False, tensorboard=False, log_progress=False,
                           tensor_inspect={"enabled": True, "features": _features(r"^typo$")})
    try:
        dm.Monitor(cfg, model=model).close()
        results["no layer"] = "no error"
    except ValueError as err:
        results["no layer"] = str(err)
    cfg = cfg.replace(tensor_inspect={"enabled": True, "features": _features(r"^model\.layers\.0\._orig_mod$")})
    try:  # a selector written for the names a compiled block had before
        dm.Monitor(cfg, model=model).close()
        results["orig_mod"] = "no error"
    except ValueError as err:
        results["orig_mod"] = str(err)
    return results


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return run_ranks(_compiled_runs, 1, str(tmp_path_factory.mktemp("compiled")), timeout=300)[0]


@pytest.mark.parametrize("how", ["torch.compile(block)", "block.compile()"])
def test_a_layer_of_one_block_compiled_per_block_gets_the_statistics_of_the_eager_model(compiled, how):
    """Blocks compiled one by one (torchtitan's way) share one code object, and Dynamo does not check
    a module's hooks before reusing compiled code by default: block 0's code, compiled without hooks,
    ran for block 1, whose selected layer's hooks never fired, and no statistic was written, without a
    word. While the hooks are on Dynamo checks them; its setting is back at close."""
    result = compiled[f"{how}, no warm-up, layers.1.fc1"]
    assert result["got"] == pytest.approx(result["truth"], rel=1e-5, abs=1e-7)
    assert result["guarded while on"] and result["restored at close"]


@pytest.mark.parametrize("how", ["torch.compile(block)", "block.compile()"])
def test_code_compiled_before_the_monitor_runs_with_its_hooks(compiled, how):
    """A forward with grad before the Monitor was made (a compile warm-up) left compiled code without
    hooks or a check of them, which ran on after the hooks were added: no statistics at all."""
    result = compiled[f"{how}, warm-up, layers.1.fc1"]
    assert result["got"] == pytest.approx(result["truth"], rel=1e-5, abs=1e-7)
    [message] = result["said"]
    assert "the code Dynamo had compiled was dropped (torch._dynamo.reset_code_caches()" in message


def test_the_dynamo_setting_is_named_in_a_warning_once(compiled):
    """The first compiled model hooked names the process-wide setting; the next (no compiled code
    dropped) does not repeat it."""
    first, second = (compiled[f"{how}, no warm-up, layers.1.fc1"]["said"]
                     for how in ("torch.compile(block)", "block.compile()"))
    assert len(first) == 1 and "skip_nnmodule_hook_guards = False" in first[0] and not second


def test_a_selected_compiled_block_counts_once_under_the_models_name(compiled):
    """torch.compile's wrapper hands its attributes to the block, nvdlfw-inspect's name included, so
    the wrapper and the block were both hooked under one name and every value counted twice (the
    l1_norm doubled); the selectors saw ``model.layers.1._orig_mod``. The wrapper is no layer: the
    block is selected by its place in the model, as without compile, and counted once."""
    result = compiled["torch.compile(block), no warm-up, layers.1"]
    assert result["got"] == pytest.approx(result["truth"], rel=1e-5, abs=1e-7)


def test_a_section_selecting_no_layer_of_a_compiled_model_lists_its_names_once(compiled):
    """The example names listed ``model.layers.0._orig_mod`` twice (the wrapper answers with the name of
    the block it wraps)."""
    assert compiled["no layer"].endswith(
        "select no layer of the model on any rank (layer names look like ['model', 'model.inp', 'model.layers.0', "
        "'model.layers.0.fc1'])"), compiled["no layer"]


def test_a_selector_naming_the_compile_wrappers_level_is_told_the_names_have_none(compiled):
    assert compiled["orig_mod"].endswith(
        "; layer names have no '_orig_mod' level: torch.compile's wrapper takes the name of the module it wraps, "
        "as an eager model names it"), compiled["orig_mod"]


def _fullgraph(rank: int, world: int, root: str, how: str) -> str:
    import torch
    from torch.distributed.fsdp import fully_shard

    import distmetrics as dm

    model = _net()
    _compile_blocks(model, how, fullgraph=True)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    cfg = dm.MetricsConfig(output_dir=f"{root}/out{rank}", console=False, tensorboard=False, log_progress=False,
                           hang_timeout_s=30, tensor_inspect={"enabled": True, "features": _features(r"fc1$")})
    try:
        with dm.Monitor(cfg, model=model) as monitor:
            model(torch.randn(4, 8)).backward()
            monitor.step(1)
    except Exception as err:  # noqa: BLE001 - the test reads what was raised
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize("how", ["torch.compile(block)", "block.compile()"])
def test_a_layer_inside_a_fullgraph_block_is_refused_at_start_on_every_rank(tmp_path, how):
    """Blocks compiled with fullgraph=True (torchtitan's way), then fully_shard, with statistics of a
    layer inside them: every rank raised Dynamo's Unsupported at the first forward, pointing at our
    hook. The Monitor refuses it at start, naming the layer, the block and what works."""
    for message in run_ranks(_fullgraph, 2, str(tmp_path), how, timeout=180):
        assert message.startswith("ConfigError: tensor_inspect.features: layer 'model.layers.0.fc1' is inside "
                                  "'layers.0', compiled with torch.compile(fullgraph=True)"), message
        assert "compile it without fullgraph=True, or select no layer inside it" in message


def _other_tools_compile_state(rank: int, world: int, root: str) -> dict:
    """A compile callback another tool registered and a function compiled before a Monitor with tensor
    statistics on an eager model: what is left of them once the Monitor drops Dynamo's cached code."""
    import torch
    import torch._dynamo

    import distmetrics as dm

    seen: list = []
    torch._dynamo.callback_handler.register_start_callback(lambda *a: seen.append("start"))

    @torch.compile(backend="aot_eager")
    def other(x):
        return (x.sin() * 2).sum()

    other(torch.randn(4))
    callbacks = len(torch._dynamo.callback_handler.start_callbacks)
    model = _net()
    cfg = dm.MetricsConfig(output_dir=root, log_interval=1, console=False, tensorboard=False, log_progress=False,
                           timing_log_level=-1, tensor_inspect={"enabled": True, "features": _features(r"fc1$")})
    with dm.Monitor(cfg, model=model) as monitor:
        model(torch.randn(4, 8)).backward()
        other(torch.randn(4))  # compiles again (its code was dropped): the callback runs again
        monitor.step(1)
    return {"before": callbacks, "after": len(torch._dynamo.callback_handler.start_callbacks), "starts": len(seen)}


def test_dropping_compiled_code_keeps_what_other_tools_registered_with_dynamo(tmp_path):
    """torch._dynamo.reset() dropped other tools' compile callbacks (and compiled autograd, CUDA graphs)
    with the cached code; only the code is dropped now."""
    out = run_ranks(_other_tools_compile_state, 1, str(tmp_path), timeout=180)[0]
    assert out["after"] == out["before"] >= 1, out
    assert out["starts"] == 2, out  # the first compile, and the one after the code was dropped


def _ops_run_compiled(rank: int, world: int, root: str) -> dict:
    """The operations of a forward that ran inside compiled graphs (each graph's operations, each time
    it ran), on the second step (the first compiles), for the README's three ways of compiling a model
    of 4 blocks (20 operations a forward), with and without a hooked fc1 in each block; the features
    select no step, as on most steps of a run."""
    import torch
    import torch._dynamo
    from torch._dynamo import lookup_backend
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    import distmetrics as dm

    def counting(ran: list):
        aot_eager = lookup_backend("aot_eager")

        def backend(gm, example_inputs):
            ops = sum(node.op in ("call_function", "call_method", "call_module") for node in gm.graph.nodes)
            compiled = aot_eager(gm, example_inputs)

            def run(*args):
                ran.append(ops)
                return compiled(*args)
            return run
        return backend

    features = _features(r"fc1$")
    for entry in features["s"]["distmetrics"]["LogTensorStats"]["tensors_struct"]:
        entry["freq"] = 1000
    out = {}
    for how in ("torch.compile(model)", "block.compile()", "torch.compile(checkpoint_wrapper(block))"):
        for stats in (False, True):
            torch._dynamo.reset()
            model, ran = _net(blocks=4), []
            if how == "torch.compile(model)":
                model = torch.compile(model, backend=counting(ran))
            for i in range(4 if how != "torch.compile(model)" else 0):
                if how == "block.compile()":
                    model.layers[i].compile(backend=counting(ran))
                else:
                    model.layers[i] = torch.compile(checkpoint_wrapper(model.layers[i]), backend=counting(ran))
            cfg = dm.MetricsConfig(output_dir=f"{root}/{len(out)}", console=False, tensorboard=False,
                                   log_progress=False, timing_log_level=-1,
                                   tensor_inspect={"enabled": stats, "features": features})
            with dm.Monitor(cfg, model=model) as monitor:
                for step in (1, 2):
                    del ran[:]
                    model(torch.randn(4, 8)).backward()
                    monitor.step(step)
            out[how, stats] = list(ran)
    return out


def test_the_operations_left_in_compiled_graphs_are_the_readmes(tmp_path):
    """README (Tensor statistics, under torch.compile): a whole-model compile ran 12 of the 20
    operations in compiled graphs (20 without statistics); per-block compile all 16 of the blocks', in
    two graphs a block; a compiled checkpoint_wrapper(block) none (8 without)."""
    out = run_ranks(_ops_run_compiled, 1, str(tmp_path), timeout=300)[0]
    assert sum(out["torch.compile(model)", False]) == 20 and sum(out["torch.compile(model)", True]) == 12, out
    assert out["block.compile()", False] == [4] * 4, out
    assert sum(out["block.compile()", True]) == 16 and len(out["block.compile()", True]) == 2 * 4, out
    assert sum(out["torch.compile(checkpoint_wrapper(block))", False]) == 8, out
    assert out["torch.compile(checkpoint_wrapper(block))", True] == [], out

"""The accelerator execution model on the CPU backend with inductor: every
shape is warmed up, serving compiles nothing, results equal eager and HF."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch
import torch._inductor.config
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from helpers import hf_greedy, model_runner, running_llm
from test_generation import random_prompts

pytestmark = pytest.mark.slow  # engines and servers: the full suite only

MAX_MODEL_LEN = 256
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64, max_num_seqs=8)
BUCKETS = "1,4,16,64"
WARMUP_LINE = re.compile(r"vllm_accel warmup finished in ([\d.]+) s: (\d+) graphs")


def accel_config(cache_dir, **settings) -> dict:
    options = {"compile_backend": "inductor", "token_buckets": BUCKETS,
               "compile_cache_dir": str(cache_dir)}
    options.update(settings)
    return {"accel": options}


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture()
def warmup_log():
    handler = LogLines()
    logger = logging.getLogger("vllm.vllm_accel.worker.warmup")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def greedy(llm, prompts, max_tokens=8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="module")
def compiled(tiny_models, cache_dir):
    """One inductor engine, started cold (empty compile cache), cutting steps
    by the forward times it measures at warmup (forward_plan=measured)."""
    # As under `vllm serve`: vLLM's TORCHINDUCTOR_COMPILE_THREADS=1 is read when
    # torch comes after vllm (in this process torch came first, so set it here).
    torch._inductor.config.compile_threads = 1
    # As in a new process: inductor has not probed the CPU's vector ISA yet.
    from torch._inductor.cpu_vec_isa import VecISA, valid_vec_isa_list
    valid_vec_isa_list.cache_clear()
    VecISA._VecISA__bool__impl.cache_clear()
    started = time.perf_counter()
    with running_llm(tiny_models["llama"],
                     additional_config=accel_config(cache_dir, forward_plan="measured"),
                     **ENGINE) as llm:
        yield llm, time.perf_counter() - started


def test_warmup_compiles_every_bucket_once(compiled):
    llm, _ = compiled
    runner = model_runner(llm)
    assert runner.token_buckets == [1, 4, 16, 64]
    # On cpu one graph serves buckets 4, 16 and 64 (settings.bucket_graphs):
    # the decoder layers' and the final norm's, each beside one for bucket 1.
    assert runner.backend.shared_bucket_graphs
    assert runner.compile_stats.warmup_graphs == 2 * 2
    assert runner.compile_stats.cache_hits == (0, 4)
    assert runner.compile_stats.tuning_benchmarks == 0  # the cpu's C++ kernels are not tuned
    # vLLM pins inductor to one compile thread; the worker gives it its cores.
    assert torch._inductor.config.compile_threads == torch.get_num_threads()


def test_kernel_tuning_is_counted_from_the_engines_start(monkeypatch):
    """The start-up line's tuning count (a warm start on cuda should show 0:
    tests/test_cuda.py) is inductor's process-wide counters read as a delta."""
    from torch._dynamo.utils import counters

    from vllm_accel.worker.compile_stats import CompileStats

    inductor = counters["inductor"]
    for name in ("coordesc_tuning_bench", "select_algorithm_autotune"):
        monkeypatch.setitem(inductor, name, inductor[name])  # restored afterwards
    inductor["coordesc_tuning_bench"] += 5  # an earlier engine's
    stats = CompileStats()
    inductor["coordesc_tuning_bench"] += 3
    inductor["select_algorithm_autotune"] += 1
    assert stats.tuning_benchmarks == 4


def test_the_vector_isa_probe_is_not_rebuilt_per_compile_cache(compiled, cache_dir):
    """Inductor's probe of the CPU's vector instructions (a test program
    built per instruction set) ran outside the engine's compile cache: a new
    compile cache does not build it again (patches.py, 13)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    assert valid_vec_isa_list.cache_info().currsize == 1  # probed by this engine
    probes = [f for f in cache_dir.rglob("*.cpp") if "__avx_chk_kernel" in f.read_text()]
    assert not probes, f"the vector-ISA probe was built in the compile cache: {probes}"
    assert any(cache_dir.rglob("*.cpp")), "the engine compiled nothing into its cache"


def test_warmup_times_every_buckets_forward(compiled):
    """Warmup times each bucket's forward and plans steps with those times
    (not the token-count estimate the runner starts with)."""
    from vllm_accel.buckets import plan_forwards, token_count_costs

    runner = model_runner(compiled[0])
    costs = runner.forward_costs
    assert costs != token_count_costs(runner.token_buckets)
    for seconds in (costs.first, costs.later):
        assert len(seconds) == 4 and 0 < seconds[0] and list(seconds) == sorted(seconds)
        assert seconds[-1] < 10, f"forward times are seconds, got {costs}"
    assert runner.forward_times is None  # timing is over
    for bucket in runner.token_buckets:  # a step of exactly one bucket: one forward
        assert plan_forwards(bucket, runner.token_buckets, costs) == [bucket]


def test_mixed_workload_compiles_nothing_and_matches_hf(compiled, tiny_models):
    llm, _ = compiled
    runner = model_runner(llm)
    model_dir = tiny_models["llama"]
    graphs_before = runner.compile_stats.graphs_compiled
    layer_forwards = [layer.forward for layer in runner.model.fms_model.base_model.layers]
    guarded_before = [forward.guarded_calls for forward in layer_forwards]
    assert runner.kernels.decode is not None, "the cpu decode kernel did not build"
    kernel_calls_before = runner.kernels.decode.calls

    # 1 request, then max_num_seqs at once, lengths across bucket boundaries up
    # to max_model_len; then a prefix hit; then n>1; then arrivals mid-decode.
    single = random_prompts([5], seed=10)
    batch = random_prompts([1, 3, 4, 5, 16, 17, 63, 240], seed=11)
    shared = random_prompts([100], seed=12)[0]
    prefix_pair = [shared + t for t in random_prompts([7, 9], seed=13)]
    got = greedy(llm, single) + greedy(llm, batch) + greedy(llm, prefix_pair)
    expected = hf_greedy(model_dir, single + batch + prefix_pair, 8)
    assert got == expected

    n_params = SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=6)
    assert len(llm.generate([TokensPrompt(prompt_token_ids=batch[4])], n_params,
                            use_tqdm=False)[0].outputs) == 3
    # Logprobs (vLLM ranks them with a torch.compile'd helper), penalties, top-k/p,
    # seeds, at batch sizes 1 and 3.
    for prompts, params in (
        (batch[:1], SamplingParams(temperature=0, max_tokens=4, logprobs=3)),
        (batch[:3], SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=3, max_tokens=4,
                                   logprobs=2, presence_penalty=0.5, repetition_penalty=1.2)),
    ):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                            use_tqdm=False)
        assert all(len(o.outputs[0].logprobs) == 4 for o in outs)

    engine = llm.llm_engine
    late = random_prompts([30, 2, 70], seed=14)
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs, step = {}, 0
    while step < 6 or engine.has_unfinished_requests():
        if step in (0, 2, 5):
            i = (0, 2, 5).index(step)
            engine.add_request(f"late-{i}", TokensPrompt(prompt_token_ids=late[i]), params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    assert [outputs[f"late-{i}"] for i in range(3)] == hf_greedy(model_dir, late, 8)

    assert runner.compile_stats.runtime_compiles == 0
    assert runner.compile_stats.graphs_compiled == graphs_before
    # Warmup made every kind of layer call once: serving checks no dynamo guards.
    assert [forward.guarded_calls for forward in layer_forwards] == guarded_before
    # Decodes went through the CPU decode-attention kernel (not the PyTorch path).
    assert runner.kernels.decode.calls > kernel_calls_before


def test_inductor_equals_eager(compiled, tiny_models):
    llm, _ = compiled
    prompts = random_prompts([2, 15, 16, 17, 64, 65, 200], seed=15)
    with running_llm(tiny_models["llama"], **ENGINE,
                     additional_config={"accel": {"token_buckets": BUCKETS}}) as eager:
        assert model_runner(eager).backend.compile_backend == "eager"
        assert greedy(eager, prompts, 12) == greedy(llm, prompts, 12)


def test_second_start_uses_the_compile_cache(compiled, tiny_models, cache_dir, warmup_log):
    _, cold_s = compiled
    started = time.perf_counter()
    with running_llm(tiny_models["llama"], additional_config=accel_config(cache_dir),
                     **ENGINE) as llm:
        warm_s = time.perf_counter() - started
        stats = model_runner(llm).compile_stats
        assert stats.cache_hits == (4, 0)
        # Every graph loaded whole (model/saved_graphs.py): dynamo traced
        # nothing, and the loaded graphs compute what HF does.
        assert (stats.graphs_loaded, stats.graphs_compiled) == (4, 0)
        prompts = random_prompts([3, 17, 70], seed=18)
        assert greedy(llm, prompts) == hf_greedy(tiny_models["llama"], prompts, 8)
    match = next(m for m in map(WARMUP_LINE.search, warmup_log) if m)
    assert int(match.group(2)) == 4
    print(f"engine start: cold {cold_s:.1f} s, with compile cache {warm_s:.1f} s "
          f"(warmup {float(match.group(1)):.1f} s)")


def test_a_graph_per_bucket_computes_what_the_shared_graph_does(compiled, tiny_models,
                                                                cache_dir):
    """bucket_graphs=per_bucket, the static shapes of an accelerator: a graph
    for each bucket (not the shared graphs saved in the same cache), and the
    same tokens as the engine whose graph reads the token count at run time."""
    llm, _ = compiled
    config = accel_config(cache_dir, bucket_graphs="per_bucket")
    prompts = random_prompts([2, 15, 16, 17, 64, 65, 200], seed=19)
    with running_llm(tiny_models["llama"], additional_config=config, **ENGINE) as static:
        runner = model_runner(static)
        assert not runner.backend.shared_bucket_graphs
        # The layers' graph and the final norm's, for each of 4 buckets.
        assert runner.compile_stats.warmup_graphs == runner.compile_stats.graphs_compiled == 2 * 4
        assert greedy(static, prompts, 12) == greedy(llm, prompts, 12)
        assert runner.compile_stats.runtime_compiles == 0


@pytest.mark.parametrize("arch,graphs", [("llama", 2 * 2), ("bamba", 3 * 2)])
def test_layers_that_store_their_keys_share_the_graphs_and_match_hf(arch, graphs, tiny_models,
                                                                    tmp_path, monkeypatch):
    """The layers storing keys/values in their own graphs (a GPU's layout;
    forced here on the cpu): the slot mapping rides the shared graph's bucket
    axis (a graph for bucket 1 and one for the rest, per kind of layer and
    for the final norm; none compiled while serving), Mamba2 blocks take no
    slots, and greedy tokens over chunked prompts and decodes equal HF's."""
    from vllm_accel.model.paged_attention import PagedAttentionMetadata

    monkeypatch.setattr(PagedAttentionMetadata, "stored_by_layers", property(lambda md: True))
    prompts = random_prompts([2, 15, 16, 17, 64, 65, 200], seed=23)
    with running_llm(tiny_models[arch], additional_config=accel_config(tmp_path),
                     **ENGINE) as llm:
        runner = model_runner(llm)
        assert runner.compile_stats.warmup_graphs == graphs
        assert greedy(llm, prompts, 12) == hf_greedy(tiny_models[arch], prompts, 12)
        assert runner.compile_stats.runtime_compiles == 0


@pytest.mark.parametrize("arch", ["llama", "gpt_bigcode"])
def test_the_final_norm_takes_one_graph_for_every_bucket_above_1(arch, tiny_models):
    """The final norm compiled with shared graphs: one for 1 token and one
    for every larger bucket, called with fresh tensors (not ones the layers
    marked), whether its input is FMS's ``x`` or torch's LayerNorm's
    ``input`` (GPT-BigCode); with graphs per bucket, one for each."""
    from transformers import AutoConfig

    from vllm_accel.compat import dynamo_graph_count
    from vllm_accel.model.fms_causal_lm import FmsCausalLM, load_fms_model

    path = tiny_models[arch]
    for shared, graphs in ((True, 2), (False, 3)):
        model = FmsCausalLM(load_fms_model(str(path), AutoConfig.from_pretrained(path),
                                           torch.float32))
        model.compile_layers("eager", [1, 4, 16], shared=shared)
        before = dynamo_graph_count()
        for tokens in (1, 4, 16, 4):
            model.fms_model.base_model.dec_norm(torch.randn(1, tokens, model.hidden_size))
        assert dynamo_graph_count() - before == graphs


def test_compiled_graphs_are_kept_per_op_schemas(compiled, cache_dir, monkeypatch):
    """Graphs call our ops by their schemas, which inductor's cache does not
    key on: the engine's graphs live in a folder named by them, and another
    schema names another folder (an old graph is not loaded to call an op
    whose arguments changed)."""
    from vllm_accel.kernels import ops

    graphs = model_runner(compiled[0]).compile_stats.cache_dir
    assert graphs == cache_dir / "inductor" / f"ops-{ops.fingerprint()}"
    assert {schema.split("(")[0] for schema in ops._schemas} == {
        "blocked_linear", "packed_linear", "span_attention", "paged_attention", "mamba2_mixer",
        "experts"}
    assert any(graphs.rglob("*.py")), "the engine cached no graph there"
    before = ops.fingerprint()
    monkeypatch.setattr(ops, "_schemas", [*ops._schemas[:-1], ops._schemas[-1] + " "])
    assert ops.fingerprint() != before


def test_a_hybrid_model_compiles_each_layer_kind_per_bucket_and_matches_hf(tiny_models,
                                                                          cache_dir):
    """Bamba: its attention and Mamba2 blocks are two stacks, each compiled
    once per bucket (bucket_graphs=per_bucket: static shapes), the Mamba2
    state read and written by an op; serving (decodes and chunks packed, a
    prompt longer than a step) compiles nothing and equals HF."""
    config = accel_config(cache_dir, bucket_graphs="per_bucket")
    prompts = random_prompts([1, 3, 16, 17, 63, 200], seed=24)
    with running_llm(tiny_models["bamba"], additional_config=config, **ENGINE) as llm:
        runner = model_runner(llm)
        # (2 kinds of layer + the final norm) x 4 buckets
        assert runner.compile_stats.warmup_graphs == 12
        assert greedy(llm, prompts) == hf_greedy(tiny_models["bamba"], prompts, 8)
        assert runner.compile_stats.runtime_compiles == 0


def test_windowed_and_full_attention_layers_share_one_graph_per_bucket_and_match_hf(
        tiny_models, cache_dir):
    """Granite SWA: a full-attention layer and three windowed ones (four KV
    cache groups, each its own attention layout), all with attention sinks.
    A layer's group reaches the op as a tensor, not a constant, so all four
    layers run one graph per bucket (per_bucket: static shapes); serving
    (decodes and chunks packed, prompts past the window and past a step)
    compiles nothing and equals HF."""
    config = accel_config(cache_dir, bucket_graphs="per_bucket")
    prompts = random_prompts([1, 3, 16, 30, 63, 200], seed=24)
    with running_llm(tiny_models["granite_swa"], additional_config=config, **ENGINE) as llm:
        runner = model_runner(llm)
        assert len(runner.kv_cache.layouts) == 4
        # (one kind of layer + the final norm) x 4 buckets
        assert runner.compile_stats.warmup_graphs == 8
        assert greedy(llm, prompts) == hf_greedy(tiny_models["granite_swa"], prompts, 8)
        assert runner.compile_stats.runtime_compiles == 0


def test_step_beyond_every_bucket_runs_as_several_forwards(tiny_models, cache_dir):
    config = accel_config(cache_dir, token_buckets="1,4,16")
    with running_llm(tiny_models["llama"], additional_config=config, **ENGINE) as llm:
        runner = model_runner(llm)
        forwards = []
        run_forward = runner._run_forward
        runner._run_forward = lambda fwd, *args, **kwargs: forwards.append(
            fwd.bucket) or run_forward(fwd, *args, **kwargs)
        # 40- and 64-token steps > the largest bucket (16): forwards of 16, no new graph.
        prompts = random_prompts([40, 64], seed=16)
        assert greedy(llm, prompts) == hf_greedy(tiny_models["llama"], prompts, 8)
        assert forwards.count(16) >= 6 and set(forwards) <= {1, 4, 16}
        assert runner.compile_stats.runtime_compiles == 0


def test_skip_warmup_compiles_lazily(tiny_models, cache_dir, warmup_log, monkeypatch):
    monkeypatch.setenv("VLLM_SKIP_WARMUP", "true")
    with running_llm(tiny_models["llama"], additional_config=accel_config(cache_dir),
                     **ENGINE) as llm:
        runner = model_runner(llm)
        stats = runner.compile_stats
        assert stats.graphs_compiled == stats.graphs_loaded == 0
        # Nothing was timed: steps are cut by the token-count estimate.
        from vllm_accel.buckets import token_count_costs
        assert runner.forward_costs == token_count_costs(runner.token_buckets)
        prompt = random_prompts([10], seed=17)
        assert greedy(llm, prompt) == hf_greedy(tiny_models["llama"], prompt, 8)
        # 16 (prefill), 1 (decode): compiled, or loaded where an engine before
        # in this cache saved them (the module's earlier tests did).
        assert stats.graphs_compiled + stats.graphs_loaded == 2 * 2  # layers, final norm
    assert not any(WARMUP_LINE.search(line) for line in warmup_log)


def test_precompile_fills_a_cache_a_server_starts_from(tiny_models, tmp_path):
    """`python -m vllm_accel.precompile` compiles every bucket into a directory;
    an engine started with the same options then loads them all from it."""
    import json
    import os
    import subprocess
    import sys

    cache = tmp_path / "shipped-cache"
    config = {"accel": {"compile_backend": "inductor", "token_buckets": "1,4"}}
    cmd = [sys.executable, "-m", "vllm_accel.precompile", tiny_models["llama"],
           "--compile-cache-dir", str(cache), "--max-model-len", str(MAX_MODEL_LEN),
           "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
           "--additional-config", json.dumps(config)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    output = done.stdout + done.stderr  # vLLM's logger writes to stdout
    assert done.returncode == 0, output[-3000:]
    assert "vllm_accel precompile:" in output

    config["accel"]["compile_cache_dir"] = str(cache)
    with running_llm(tiny_models["llama"], additional_config=config, **ENGINE) as llm:
        assert model_runner(llm).compile_stats.cache_hits == (4, 0)


class Scaled(torch.nn.Module):
    """A layer whose graph depends on an attribute and an argument (dynamo
    bakes ints in)."""

    def __init__(self, factor: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.factor = factor

    def forward(self, x, *, shift=0.0):
        return (x @ self.weight) * self.factor + shift


def test_each_layer_runs_its_graph_without_guards_once_it_has_seen_a_kind_of_call():
    """compile.LayerForward: the first call of a kind (shapes, strides, dtypes,
    other arguments' values) goes through dynamo, later ones straight to the
    graph dynamo picked for that layer, which computes what eager does."""
    from vllm_accel.model.compile import compile_shared_forward

    layers = [Scaled(2), Scaled(2), Scaled(3)]
    compile_shared_forward(layers, "eager", num_shapes=4)
    x = torch.randn(5, 4)
    kinds = [((x,), {}), ((torch.randn(6, 4),), {}), ((torch.randn(7, 4),), {}),
             ((x,), {"shift": 1}), ((x,), {"shift": 2}), ((x.double(),), {})]
    with torch.no_grad():
        for seen, (args, kwargs) in enumerate(kinds, start=1):
            for _ in range(3):
                for layer in layers:
                    if args[0].dtype == torch.float64:
                        layer.double()
                    got = layer(*args, **kwargs)
                    assert torch.equal(got, Scaled.forward(layer, *args, **kwargs))
            assert [layer.forward.guarded_calls for layer in layers] == [seen] * 3


@pytest.mark.parametrize("user_set", [None, "1"])
def test_the_shared_graph_compiles_without_coordinate_descent_tuning(user_set, monkeypatch):
    """Patch 18's exception: where inductor tunes (the cuda backend turns
    coordinate descent on), the graph that serves every bucket above 1
    compiles without it, the one-row graph with it; a user's
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING holds for both."""
    from vllm_accel.model.compile import BucketAxis, compile_shared_forward

    if user_set is None:
        monkeypatch.delenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_COORDINATE_DESCENT_TUNING", user_set)
    tuned_at_compile = []

    def backend(graph, example_inputs):
        tuned_at_compile.append(torch._inductor.config.coordinate_descent_tuning)
        return graph.forward

    layers = [Scaled(2), Scaled(2)]
    compile_shared_forward(layers, backend, num_shapes=3,
                           bucket_axis=BucketAxis((("x", 0),), largest=8))
    with torch.no_grad(), torch._inductor.config.patch(coordinate_descent_tuning=True):
        for rows in (8, 1, 4):
            for layer in layers:
                layer(torch.randn(rows, 4))
    assert tuned_at_compile == [user_set is not None, True]  # the shared graph, then one row


def test_a_layer_takes_its_hidden_states_row_by_row():
    """A strided hidden state (SigLIP's patches come transposed from its
    convolution) enters the compiled layer contiguous: the graph's output,
    and so every later layer's input, takes that layout, and a transposed
    one of the same shape is the same kind of call."""
    from vllm_accel.model.compile import compile_shared_forward

    class Elementwise(torch.nn.Module):
        def forward(self, x):
            return x * 2  # laid out as its input

    layers = [Elementwise(), Elementwise()]
    compile_shared_forward(layers, "eager", num_shapes=2)
    transposed = torch.randn(3, 729, 16).transpose(1, 2)  # [3, 16, 729], strides of [3, 729, 16]
    with torch.no_grad():
        out = layers[1](layers[0](transposed))
        assert out.is_contiguous() and torch.equal(out, transposed * 4)
        layers[0](transposed.contiguous())
    assert [layer.forward.guarded_calls for layer in layers] == [1, 1]


def test_warming_up_runs_each_kind_of_call_in_one_layer_of_a_stack():
    """A forward context that is warming up: the first layer to make a kind of call runs it;
    the others of its stack get their graph from dynamo's guards and pass
    their input on, so after warmup every layer runs its graph unguarded.
    A layer whose output is not shaped as its input always runs."""
    from vllm_accel.forward_context import ForwardContext, set_forward_context
    from vllm_accel.model.compile import compile_shared_forward

    class Residual(torch.nn.Module):
        def forward(self, x):
            return x * 2

    class Shrinking(torch.nn.Module):
        def forward(self, x):
            return x[1:] * 2

    residual, shrinking = [Residual() for _ in range(3)], [Shrinking() for _ in range(3)]
    compile_shared_forward(residual, "eager", num_shapes=2)
    compile_shared_forward(shrinking, "eager", num_shapes=8)
    x, y = torch.randn(5, 4), torch.randn(6, 4)
    with torch.no_grad():
        with set_forward_context(ForwardContext(warming_up=True)):
            assert torch.equal(residual[2](residual[1](residual[0](x))), x * 2)
            assert [torch.equal(layer(y), y * (2 if i == 0 else 1))
                    for i, layer in enumerate(residual)] == [True] * 3
            assert torch.equal(residual[0](x), x)  # its kind ran: passes through too
            assert torch.equal(shrinking[2](shrinking[1](shrinking[0](x))), x[3:] * 8)
        assert [layer.forward.guarded_calls for layer in residual] == [2, 0, 0]
        for layer in residual:
            assert torch.equal(layer(x), x * 2) and torch.equal(layer(y), y * 2)
        assert torch.equal(residual[2](residual[1](residual[0](x))), x * 8)
    assert [layer.forward.guarded_calls for layer in residual] == [2, 0, 0]


def test_saved_graphs_load_without_dynamo_per_layer_kind_and_source(tmp_path, monkeypatch):
    """model/saved_graphs.py: a kind of call's graph is compiled once and
    saved; a later start (new layers, a new store) loads it whole, dynamo
    tracing nothing, and computes what eager does. A layer with other
    attributes gets a graph of its own, and a graph whose traced source has
    changed is compiled again."""
    from torch._dynamo.utils import counters
    from vllm_accel.model import saved_graphs
    from vllm_accel.model.compile import compile_shared_forward

    def start(*factors):
        layers = [Scaled(f) for f in factors]
        for layer in layers:  # one set of weights, so outputs compare across starts
            layer.weight.data = torch.arange(16.0).reshape(4, 4) / 16
        compile_shared_forward(layers, "inductor", 2, saved_graphs.SavedGraphs(tmp_path))
        return layers

    x = torch.randn(5, 4)
    with torch.no_grad():
        before = saved_graphs.counts()
        for layer in start(2, 2):
            assert torch.allclose(layer(x), Scaled.forward(layer, x))
        assert saved_graphs.counts() == (before[0], before[1] + 1)
        assert len(list(tmp_path.glob("*.graph"))) == 1

        traced = counters["stats"]["unique_graphs"]
        layers = start(2, 2, 3)
        for layer in layers:
            assert torch.allclose(layer(x), Scaled.forward(layer, x))
        # The factor-2 graph loaded (dynamo traced only the factor-3 layer's).
        assert saved_graphs.counts() == (before[0] + 1, before[1] + 2)
        assert counters["stats"]["unique_graphs"] == traced + 1
        assert len(list(tmp_path.glob("*.graph"))) == 2
        assert [layer.forward.guarded_calls for layer in layers] == [1, 1, 1]

        saved_graphs._module_source.cache_clear()
        real = saved_graphs._module_source
        monkeypatch.setattr(saved_graphs, "_module_source",
                            lambda name: real(name) + "# edited" if name == __name__ else
                            real(name))
        for layer in start(2):
            assert torch.allclose(layer(x), Scaled.forward(layer, x))
        assert saved_graphs.counts() == (before[0] + 1, before[1] + 3)


class IgnoresMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.eye(4) * 2)

    def forward(self, x, mask):
        return x @ self.weight


def test_a_kind_of_call_differing_in_what_the_graph_does_not_read_shares_its_graph(tmp_path):
    """A call whose only difference is an argument the graph does not read
    (Qwen2.5-VL's window and full-attention masks, where attention goes by
    spans) passes the first graph's guards: no second compile, and a file
    names that graph for later starts, which load it once for both."""
    from vllm_accel.model import saved_graphs
    from vllm_accel.model.compile import compile_shared_forward

    x = torch.randn(3, 4)
    with torch.no_grad():
        for run in range(2):
            before = saved_graphs.counts()
            layer = IgnoresMask()
            compile_shared_forward([layer], "inductor", 2, saved_graphs.SavedGraphs(tmp_path))
            for mask in (torch.ones(3, 3), torch.ones(1, 3, 9)):
                assert torch.equal(layer(x, mask), x * 2)
            loaded, compiled = (a - b for a, b in zip(saved_graphs.counts(), before))
            assert (loaded, compiled) == ((0, 1) if run == 0 else (1, 0))
            assert len(list(tmp_path.glob("*.graph"))) == 1
            assert len(list(tmp_path.glob("*.same"))) == 1


def test_a_layer_whose_graphs_cannot_be_saved_compiles_through_dynamo(tmp_path):
    """A layer dynamo cannot save with its graph (here a class defined in a
    function) runs through dynamo's own path, as without saved graphs."""
    from vllm_accel.model import saved_graphs
    from vllm_accel.model.compile import compile_shared_forward

    class Local(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.factor = 2  # read, so guarded: dynamo saves the module's class

        def forward(self, x):
            return x * self.factor

    layers = [Local(), Local()]
    compile_shared_forward(layers, "inductor", 2, saved_graphs.SavedGraphs(tmp_path))
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(2):
            assert all(torch.equal(layer(x), x * 2) for layer in layers)
    assert [layer.forward.guarded_calls for layer in layers] == [1, 1]
    assert not list(tmp_path.glob("*.graph"))

"""Strategies and families from outside the package: the examples under ``examples/plugins/`` register through the
plugin mechanism, with no package file edited and nothing patched, and run through every front end (Python, the
CLI, a YAML bench config, the HTTP server, an installed entry point).

The strategy, ``fixed_k``, takes the two most confident masks of every block each step: the engine's tokens must be
the reference decoder's configured for two tokens per block. The family, ``toy_sdar``, is SDAR under another
``model_type``: its tokens must be SDAR's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from diffulex import Diffulex, SamplingParams
from diffulex.testing.distributed import free_port
from diffulex.testing.reference_decoder import reference_for_engine

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "plugins"
FIELDS = dict(block_size=4, page_size=8, buffer_size=2, max_model_len=128, max_num_batched_tokens=256, max_num_reqs=4)
PROMPT = "the quick brown fox"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def plugins_importable() -> Iterator[None]:
    """The examples folder on the import path, as a user's own package would be (the package is not touched)."""
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def toy_sdar_dir(peaky_sdar_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The peaky SDAR checkpoint, published under model_type "toy_sdar" (no architecture SDAR would recognise)."""
    folder = tmp_path_factory.mktemp("toy") / "toy-sdar"
    shutil.copytree(peaky_sdar_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="toy_sdar", architectures=["ToySdarForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def plugin_env(*extra: Path) -> dict[str, str]:
    """The environment of a fresh process that can import the examples (and ``extra`` folders)."""
    paths = [str(p) for p in (*extra, EXAMPLES)] + [os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def run_cli(args: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diffulex.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def engine_flags() -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in FIELDS.items()]


@pytest.fixture(scope="module")
def fixed_k_engine(peaky_sdar_dir: Path, plugins_importable: None) -> Iterator[object]:
    llm = Diffulex(str(peaky_sdar_dir), plugins=["fixed_k"], decoding_strategy="fixed_k", **FIELDS)
    yield llm
    llm.exit()


@pytest.fixture(scope="module")
def python_answer(fixed_k_engine):
    """What the Python API answers PROMPT with under fixed_k (the other front ends must answer the same)."""
    return fixed_k_engine.generate([PROMPT], GREEDY, use_tqdm=False, apply_chat_template=False).trajectories[0]


def test_an_outside_strategy_equals_the_reference_decoder_at_two_tokens_per_block(fixed_k_engine):
    llm = fixed_k_engine
    assert llm.config.strategy.name == "fixed_k" and llm.config.strategy_options.tokens_per_block == 2
    prompts = [[5, 6, 7, 8, 9], [3, 4, 5], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, traj in zip(prompts, outputs.trajectories, strict=True):
        ref = reference_for_engine(llm, prompt, GREEDY, tokens_per_block=2)
        assert traj.token_ids == ref.token_ids
        assert [s.num_new_tokens for s in traj.steps] == ref.tokens_per_step
    # the rule is the strategy's: two blocks of the running set take two tokens each in one step
    assert max(s.num_new_tokens for t in outputs.trajectories for s in t.steps) == 4


def test_the_strategy_reads_its_own_options(peaky_sdar_dir: Path, plugins_importable: None):
    with Diffulex(
        str(peaky_sdar_dir), plugins=["fixed_k"], decoding_strategy="fixed_k",
        strategy_options={"tokens_per_block": 1}, **FIELDS,
    ) as llm:  # fmt: skip
        prompt = [5, 6, 7, 8, 9]
        (traj,) = llm.generate([prompt], GREEDY, use_tqdm=False).trajectories
        assert traj.token_ids == reference_for_engine(llm, prompt, GREEDY, tokens_per_block=1).token_ids
    with pytest.raises(ValueError, match=r"^tokens_per_block=0 is invalid: must be an integer > 0$"):
        Diffulex(str(peaky_sdar_dir), plugins=["fixed_k"], decoding_strategy="fixed_k",
                 strategy_options={"tokens_per_block": 0}, **FIELDS)  # fmt: skip
    with pytest.raises(ValueError, match=r"strategy_options of decoding_strategy='fixed_k' has unknown keys 'k'"):
        Diffulex(str(peaky_sdar_dir), plugins=["fixed_k"], decoding_strategy="fixed_k",
                 strategy_options={"k": 3}, **FIELDS)  # fmt: skip


def test_an_outside_family_alias_is_detected_from_config_json_and_decodes_as_its_family(
    peaky_sdar_dir: Path, toy_sdar_dir: Path, plugins_importable: None
):
    prompt = [5, 6, 7, 8, 9]
    with Diffulex(str(toy_sdar_dir), plugins=["toy_sdar"], **FIELDS) as llm:
        assert llm.config.model_name == "toy_sdar" and llm.config.decoding_strategy == "multi_bd"
        alias = llm.generate([prompt], GREEDY, use_tqdm=False).trajectories[0].token_ids
    with Diffulex(str(peaky_sdar_dir), **FIELDS) as llm:
        assert alias == llm.generate([prompt], GREEDY, use_tqdm=False).trajectories[0].token_ids


def test_a_plugin_that_fails_to_import_names_itself(sdar_dir: Path):
    with pytest.raises(ValueError, match=r"^plugins: 'no_such_plugin_module' could not be imported"):
        Diffulex(str(sdar_dir), plugins=["no_such_plugin_module"])


def test_a_plugin_not_on_the_path_is_told_how_to_get_there(sdar_dir: Path, tmp_path: Path):
    """`diffulex` is a console script: the folder it runs in is not on sys.path, so a plugin module sitting there is
    not found. The message says so and how to fix it; a missing import inside the plugin is reported as it is."""
    with pytest.raises(ValueError, match=r"no module named 'no_such_plugin_module' on sys.path; put the folder that "
                                         r"holds it on PYTHONPATH \(e\.g\. PYTHONPATH=\. diffulex"):
        Diffulex(str(sdar_dir), plugins=["no_such_plugin_module"])
    (tmp_path / "needs_missing.py").write_text("import no_such_dependency_module\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"'needs_missing' could not be imported: ModuleNotFoundError: No module "
                                             r"named 'no_such_dependency_module'$"):
            Diffulex(str(sdar_dir), plugins=["needs_missing"])
    finally:
        sys.path.remove(str(tmp_path))


def test_a_strategy_subclass_under_its_own_name_does_not_inherit_aliases():
    """multi_bd's aliases are its old names; a plugin's ``class X(MultiBD)`` would be refused for claiming them."""
    from diffulex.strategy.multi_bd import MultiBD

    class OwnName(MultiBD):
        name = "own_name"

    class OwnAliases(MultiBD):
        name = "own_aliases"
        aliases = ("own_old_name",)

    assert OwnName.aliases == () and OwnAliases.aliases == ("own_old_name",)
    assert "multi_block_diffusion" in MultiBD.aliases


def test_a_host_rule_that_claims_in_graph_sampling_is_refused_on_every_device():
    """A strategy inherits ``samples_in_graph = True``; a host-only sampler cannot honour it on a GPU's decode
    graphs, so the build refuses it at once, on the CPU too, naming the attribute to set."""
    from diffulex.engine.assembly import check_sampler_fits_strategy
    from diffulex.strategy.multi_bd import MultiBD

    class HostOnly(MultiBD):
        name = "host_only"

    class HostSampler:
        pass

    with pytest.raises(ValueError, match=r"decoding_strategy='host_only' is invalid: samples_in_graph is True but "
                                         r"its sampler HostSampler has no greedy_result.*samples_in_graph = False"):
        check_sampler_fits_strategy(HostOnly(), HostSampler())
    HostOnly.samples_in_graph = False
    check_sampler_fits_strategy(HostOnly(), HostSampler())


def test_the_cli_loads_plugins_named_by_flag(peaky_sdar_dir: Path, python_answer):
    result = run_cli(
        ["generate", "--model", str(peaky_sdar_dir), "--plugin", "fixed_k", "--decoding-strategy", "fixed_k",
         "--temperature", "0", "--max-tokens", "12", "--raw", "--json", "--quiet", *engine_flags(), PROMPT],
        plugin_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["outputs"][0]["token_ids"] == python_answer.token_ids


def test_a_yaml_bench_config_loads_plugins_for_the_strategy_and_the_family(toy_sdar_dir: Path, tmp_path: Path):
    pytest.importorskip("lm_eval")  # the bench extra
    config = tmp_path / "bench.yml"
    config.write_text(yaml.safe_dump({
        "engine": {"model_path": str(toy_sdar_dir), "plugins": ["fixed_k", "toy_sdar"], "decoding_strategy": "fixed_k",
                   **FIELDS, "max_model_len": 1024, "max_num_batched_tokens": 1024},
        "eval": {"dataset_name": ["arithmetic_diffulex"], "dataset_limit": 2, "max_tokens": 8, "use_tqdm": False,
                 "output_dir": str(tmp_path / "out")},
    }))  # fmt: skip
    result = run_cli(["bench", "--config", str(config)], plugin_env())
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "out").iterdir()
    report = json.loads((run_dir / "metrics.json").read_text())
    resolved = report["engine_resolved"]
    assert (resolved["model_name"], resolved["decoding_strategy"]) == ("toy_sdar", "fixed_k")
    assert resolved["strategy_options"] == {"tokens_per_block": 2}
    assert report["metrics"]["num_requests"] == 2 and report["metrics"]["num_rejected"] == 0


def test_the_http_server_serves_an_outside_strategy(peaky_sdar_dir: Path, python_answer):
    pytest.importorskip("uvicorn")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "diffulex.cli", "serve", "--model", str(peaky_sdar_dir), "--port", str(port),
         "--plugin", "fixed_k", "--decoding-strategy", "fixed_k", *engine_flags()],
        env=plugin_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        reply = httpx.post(
            base + "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0},
            timeout=60,
        ).json()
        assert reply["choices"][0]["text"] == python_answer.text
    finally:
        server.terminate()
        server.wait(30)


def test_an_installed_entry_point_registers_without_being_named(peaky_sdar_dir: Path, tmp_path: Path):
    """A distribution on the path declaring a ``diffulex.plugins`` entry point: no ``plugins`` field needed."""
    dist = tmp_path / "fixed_k_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fixed-k-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[diffulex.plugins]\nfixed_k = fixed_k\n")
    script = (
        "from diffulex.config import Config; import sys; "
        "c = Config(sys.argv[1], decoding_strategy='fixed_k', block_size=4, page_size=8, buffer_size=2, "
        "max_model_len=128, max_num_batched_tokens=256); print(c.strategy.name, c.plugins)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(peaky_sdar_dir)], env=plugin_env(tmp_path), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["fixed_k", "[]"]


TAKERS = {
    # a strategy under a built-in's name, from a module that imports no built-in strategy
    "takes_d2f": "from diffulex.strategy.strategy import Strategy, register_strategy\n"
    "class Mine(Strategy):\n    name = 'd2f'\nregister_strategy(Mine())\n",
    # a new name with a built-in's old spelling as its alias
    "takes_fast_dllm": "from diffulex.strategy.strategy import Strategy, register_strategy\n"
    "class Mine(Strategy):\n    name = 'mine'\n    aliases = ('fast_dllm',)\nregister_strategy(Mine())\n",
    # a new family with a built-in family's alias among its names
    "takes_diffucoder": "import dataclasses\nfrom diffulex.models.family import FAMILIES, register_family\n"
    "register_family(dataclasses.replace(FAMILIES.get('sdar').renamed('my_sdar'), aliases=('diffucoder',)))\n",
}


def test_a_plugin_that_takes_a_built_in_name_or_alias_is_refused_by_name_and_changes_nothing(tmp_path: Path):
    """In a fresh process (nothing read yet): the plugin is named, and the tables keep every built-in entry."""
    for module, source in TAKERS.items():
        (tmp_path / f"{module}.py").write_text(source)
    script = (
        "import sys\n"
        "from diffulex.plugins import import_plugins\n"
        "try:\n    import_plugins([sys.argv[1]])\nexcept ValueError as err:\n    print(err)\n"
        "from diffulex.strategy.strategy import STRATEGIES\nfrom diffulex.models.family import FAMILIES\n"
        "print(STRATEGIES.names(), type(STRATEGIES.get('d2f')).__module__, STRATEGIES.canonical('fast_dllm'),\n"
        "      'mine' in STRATEGIES, FAMILIES.get('diffucoder').name, 'my_sdar' in FAMILIES)\n"
    )
    expected = {
        "takes_d2f": "plugins: 'takes_d2f' could not register: decoding_strategy 'd2f' is already registered "
        "(the decoding strategy 'd2f'); choose another name",
        "takes_fast_dllm": "plugins: 'takes_fast_dllm' could not register: decoding_strategy alias 'fast_dllm' "
        "(of 'mine') is already registered (an alias of 'multi_bd'); choose another name",
        "takes_diffucoder": "plugins: 'takes_diffucoder' could not register: model_name 'diffucoder' is already "
        "registered (another name of the model family 'dream'); choose another name",
    }
    intact = (
        "['d2f', 'diffusion_gemma', 'dmax', 'fast_dllm_v2', 'multi_bd'] diffulex.strategy.d2f multi_bd False "
        "dream False"
    )
    for module, error in expected.items():
        result = subprocess.run(
            [sys.executable, "-c", script, module], env=plugin_env(tmp_path), capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [error, intact]


def test_a_registration_is_all_or_nothing():
    from diffulex.errors import RegistrationError
    from diffulex.registry import Registry

    table: Registry[object] = Registry("thing", kind="thing")
    a, b = object(), object()
    table.add("a", a, aliases=("old_a",))
    table.add("a", a, aliases=("old_a",))  # the same registration again changes nothing
    for name, kwargs, message in [
        ("b", {"aliases": ("old_b", "old_a")},
         r"^thing alias 'old_a' \(of 'b'\) is already registered \(an alias of 'a'\)"),
        ("b", {"names": ("b2", "a")}, r"^thing 'a' is already registered \(the thing 'a'\)"),
        ("old_a", {}, r"^thing 'old_a' is already registered \(an alias of 'a'\)"),
        ("b", {"aliases": ("a",)}, r"^thing alias 'a' \(of 'b'\) is already registered \(the thing 'a'\)"),
        ("b", {"aliases": ("b",)}, r"^thing alias 'b' \(of 'b'\) is given twice"),
        ("", {}, r"^thing must be a non-empty string, got ''"),
        ("b", {"aliases": "old_b"}, r"^the aliases of thing 'b' must be a tuple of names, got 'old_b'"),
    ]:  # fmt: skip
        with pytest.raises(RegistrationError, match=message):
            table.add(name, b, **kwargs)
    assert table.names() == ["a"] and table.canonical("old_a") == "a" and "old_b" not in table and "b2" not in table

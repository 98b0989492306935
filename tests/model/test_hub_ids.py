"""Hugging Face hub ids as model names (rlengine/model/hub.py): LLM, `rlengine generate`, `rlengine train`.

No test touches the network. Each runs against a Hugging Face cache in a temporary HF_HOME, laid out as
huggingface_hub lays it out (models--org--name/refs/<ref>, snapshots/<sha>/<file> symlinked to
blobs/<hash>; huggingface_hub.scan_cache_dir reads it back), holding random checkpoints written here
(tests/support/text_ckpt.py). The hub is offline (HF_HUB_OFFLINE) except in the cases that replace
huggingface_hub.snapshot_download with a stand-in: its cache lookups go to the real function, its online
calls raise huggingface_hub's own exceptions or "download" by writing the cache. huggingface_hub reads
HF_HOME / HF_HUB_OFFLINE once at import, so in-process cases patch its constants module and the one
subprocess case gets the environment.
"""

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.utils import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                   RepositoryNotFoundError, RevisionNotFoundError)

from rlengine import LLM, SamplingParams
from rlengine.cli import main
from rlengine.model import Qwen3ForCausalLM, save_pretrained
from rlengine.model.config import ConfigError, preset
from rlengine.model.factory import tokenizer_for
from rlengine.model.hub import MODEL_FILES, resolve_model
from rlengine.model.loader import load_pretrained
from tests.support.text_ckpt import build_text_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
GREEDY = SamplingParams(temperature=0, max_tokens=4)
TINY_TRAIN = ["--warmstart.steps", "0", "--train.updates", "2", "--train.prompts_per_step", "2",
              "--train.group_size", "2", "--train.dynamic_sampling", "false", "--eval.every", "100",
              "--task.num_train", "8", "--task.num_eval", "4", "--gen.max_tokens", "4", "--gen.cpu_kernels", "torch",
              "--run.progress", "false"]


def add_snapshot(cache: Path, repo_id: str, src: Path, refs=("main",)) -> str:
    """Put directory `src` into the hub cache as a commit of repo_id (named by its files' hash) and point
    `refs` at it; returns the commit sha."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in src.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()
    for f in files:
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The checkpoint directories the cache is filled from (written once per module)."""
    root = tmp_path_factory.mktemp("hub_sources")
    v1 = build_text_checkpoint(root / "v1", seed=0).path          # V = the tokenizer's vocabulary (~400)
    v2 = build_text_checkpoint(root / "v2", seed=1).path          # the same shapes, other weights
    (root / "tok").mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(v1 / name, root / "tok" / name)
    save_pretrained(Qwen3ForCausalLM(preset("tiny")), root / "small")   # V = 256 < the tokenizer's: a mismatch
    bare = Qwen3ForCausalLM(dataclasses.replace(preset("tiny"), vocab_size=1024))
    save_pretrained(bare, root / "bare")                                # no tokenizer files: needs model.tokenizer
    (root / "binonly").mkdir()
    shutil.copy(v1 / "config.json", root / "binonly" / "config.json")
    (root / "binonly" / "pytorch_model.bin").write_bytes(b"pickle")
    return SimpleNamespace(v1=v1, v2=v2, tok=root / "tok", small=root / "small", bare=root / "bare",
                           binonly=root / "binonly")


@pytest.fixture
def hub(tmp_path, monkeypatch, sources):
    """An offline hub cache in tmp_path/hf: org/name (main = v1, tag v2 = v2), org/tok (tokenizer only),
    org/small, org/bare, org/binonly."""
    home = tmp_path / "hf"
    cache = home / "hub"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))          # subprocesses read these at import
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))   # this process read them already
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    shas = {"v1": add_snapshot(cache, "org/name", sources.v1),
            "v2": add_snapshot(cache, "org/name", sources.v2, refs=("v2",))}
    for repo in ("tok", "small", "bare", "binonly"):
        add_snapshot(cache, f"org/{repo}", getattr(sources, repo))
    return SimpleNamespace(home=home, cache=cache, shas=shas, src=sources)


def online(monkeypatch, fail=None, fill=None):
    """The hub online, snapshot_download replaced: cache lookups (local_files_only) reach the real function;
    an online call raises `fail`, or (fill = (cache, src)) writes src into the cache as the download. Returns
    the list of the online calls' keyword arguments."""
    real, calls = huggingface_hub.snapshot_download, []

    def snapshot_download(repo_id, **kw):
        if kw.get("local_files_only"):
            return real(repo_id, **kw)
        calls.append(kw)
        if fail is not None:
            raise fail
        add_snapshot(Path(kw["cache_dir"]), repo_id, fill)
        return real(repo_id, **{**kw, "local_files_only": True})

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def http_error(cls, status: int):
    """One of huggingface_hub's HTTP errors as the hub client raises it (a response without a body)."""
    return cls(f"{status} Client Error", response=SimpleNamespace(status_code=status, headers={}, request=None))


def embeddings(path) -> torch.Tensor:
    return load_pretrained(path).model.embed_tokens.weight


def test_the_cache_is_laid_out_as_huggingface_hub_lays_it_out(hub):
    repos = {r.repo_id: r for r in huggingface_hub.scan_cache_dir(hub.cache).repos}
    assert set(repos) == {"org/name", "org/tok", "org/small", "org/bare", "org/binonly"}
    revs = {r.commit_hash: r.refs for r in repos["org/name"].revisions}
    assert revs == {hub.shas["v1"]: frozenset({"main"}), hub.shas["v2"]: frozenset({"v2"})}


def test_llm_loads_a_cached_hub_id_as_its_directory(hub):
    llm = LLM("org/name")
    assert torch.equal(llm.model.model.embed_tokens.weight, embeddings(hub.src.v1))
    assert llm.tokenizer.vocab_size == LLM(str(hub.src.v1)).tokenizer.vocab_size
    text = llm.generate(["Hello, my name is"], GREEDY)[0].outputs[0].text
    assert text == LLM(str(hub.src.v1)).generate(["Hello, my name is"], GREEDY)[0].outputs[0].text
    assert torch.equal(load_pretrained("org/name").model.embed_tokens.weight, embeddings(hub.src.v1))


@pytest.mark.parametrize("revision", ["v2", "sha"])
def test_a_pinned_revision_loads_that_commit(hub, revision):
    pin = hub.shas["v2"] if revision == "sha" else revision
    want = embeddings(hub.src.v2)
    assert torch.equal(LLM("org/name", revision=pin).model.model.embed_tokens.weight, want)
    assert not torch.equal(LLM("org/name").model.model.embed_tokens.weight, want)   # main is still v1


def test_a_preset_and_a_local_directory_win_over_the_hub(hub, tmp_path, monkeypatch):
    calls = online(monkeypatch, fail=AssertionError("asked the hub"))
    assert resolve_model("tiny") == "tiny"
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hub.src.v2, tmp_path / "org" / "name")   # a directory spelled like the cached hub id
    assert torch.equal(LLM("org/name").model.model.embed_tokens.weight, embeddings(hub.src.v2))
    assert calls == []


def test_an_uncached_id_downloads_only_what_rlengine_reads(hub, monkeypatch):
    calls = online(monkeypatch, fill=hub.src.v2)
    assert torch.equal(LLM("org/fresh").model.model.embed_tokens.weight, embeddings(hub.src.v2))
    assert len(calls) == 1 and calls[0]["allow_patterns"] == list(MODEL_FILES)
    for wanted in ("model.safetensors", "model.safetensors.index.json", "config.json", "tokenizer.json",
                   "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert any(Path(wanted).match(p) for p in MODEL_FILES), wanted
    assert not any(Path("pytorch_model.bin").match(p) for p in MODEL_FILES)
    LLM("org/fresh")                # now cached: no second download
    assert len(calls) == 1


def test_a_tokenizer_from_another_id_is_checked_against_the_vocabulary(hub):
    tok = tokenizer_for("org/bare", tokenizer="org/tok")
    assert tok.vocab_size == LLM(str(hub.src.v1)).tokenizer.vocab_size
    with pytest.raises(ConfigError, match=r"tokenizer 'org/tok' has a vocabulary of \d+ tokens and the model only 256"):
        tokenizer_for("org/small", tokenizer="org/tok")
    with pytest.raises(ConfigError, match="vocabulary of"):
        LLM("org/small", tokenizer="org/tok")


def test_generate_takes_a_hub_id_in_a_fresh_process(hub):
    """The CLI with HF_HOME / HF_HUB_OFFLINE in its environment (read by huggingface_hub at import)."""
    r = subprocess.run([sys.executable, "-m", "rlengine.cli", "generate", "--model", "org/name", "--revision", "v2",
                        "--prompt", "Hello, my name is", "--max-tokens", "4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    want = LLM(str(hub.src.v2)).generate(["Hello, my name is"], GREEDY)[0].outputs[0].text
    assert r.stdout == want + "\n"


@pytest.mark.parametrize("model,tokenizer", [("org/name", None), ("org/bare", "org/tok")])
def test_train_runs_on_a_hub_id(hub, tmp_path, model, tokenizer):
    extra = ["--model.tokenizer", tokenizer] if tokenizer else []
    argv = ["train", "--model.name", model, *extra, *TINY_TRAIN, "--run.out_dir", str(tmp_path / "run")]
    assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in records if "loss" in r or "actor/pg_loss" in r] == [1, 2]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["name"] == model  # as written


BIN_ONLY = "only pickled weights (pytorch_model.bin)"
# (id, argv, online: an exception the hub raises / "fill" a download without weights / None = offline, message)
FAILURES = [
    ("offline-not-cached", ["generate", "--model", "org/missing", "--prompt", "hi"], None,
     "'org/missing': no local directory of that name, and the Hugging Face hub id is not in the cache"),
    ("offline-not-cached-info-plan", ["info", "--plan", "gsm8k", "--model.name", "org/missing"], None,
     "is not in the cache"),
    ("hub-unreachable", ["generate", "--model", "org/missing", "--prompt", "hi"],
     OfflineModeIsEnabled("offline"), "'org/missing': not in the Hugging Face cache and the hub cannot be reached"),
    ("hub-unreachable-local-entry", ["train", "--model.name", "org/missing"],
     LocalEntryNotFoundError("no connection"), "cannot be reached (LocalEntryNotFoundError)"),
    ("unknown-repo", ["train", "--model.name", "org/missing"], (RepositoryNotFoundError, 404),
     "'org/missing': no local directory of that name, and no Hugging Face hub repo"),
    ("unknown-revision", ["train", "--model.name", "org/name", "--model.revision", "nope"],
     (RevisionNotFoundError, 404), "'org/name' (revision 'nope'): the hub repo has no revision 'nope'"),
    ("gated-repo", ["generate", "--model", "org/gated", "--prompt", "hi"], (GatedRepoError, 401),
     "'org/gated': the hub repo is gated"),
    ("bin-only-cached", ["generate", "--model", "org/binonly", "--prompt", "hi"], None, BIN_ONLY),
    ("bin-only-download", ["train", "--model.name", "org/nosafetensors"], "fill",
     "the hub repo has no *.safetensors weights; rlengine loads safetensors only"),
    ("revision-of-a-preset", ["generate", "--model", "tiny", "--revision", "main", "--prompt", "hi"], None,
     "'tiny' is a preset; a revision ('main') applies only to a Hugging Face hub id"),
    ("tokenizer-vocabulary-mismatch", ["train", "--model.name", "org/small", "--model.tokenizer", "org/tok"], None,
     "model.tokenizer 'org/tok' has a vocabulary of"),
    ("tokenizer-not-cached", ["train", "--model.name", "org/bare", "--model.tokenizer", "org/nothere"], None,
     "model.tokenizer 'org/nothere': no local directory"),
]


@pytest.mark.parametrize("argv,hub_online,named", [pytest.param(a, o, n, id=i) for i, a, o, n in FAILURES])
def test_a_hub_failure_is_one_line_and_exit_2(hub, argv, hub_online, named, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)      # a run directory, if one were made, lands in tmp_path

    def reached(*a, **k):            # the check must stop the command before any job or engine is built
        raise AssertionError("a bad model name got through to the real work")

    import rlengine.engine
    import rlengine.rl.trainer

    monkeypatch.setattr(rlengine.rl.trainer.Trainer, "__init__", reached)
    monkeypatch.setattr(rlengine.engine, "LLM", reached)
    calls = []
    if isinstance(hub_online, tuple):
        calls = online(monkeypatch, fail=http_error(*hub_online))
    elif isinstance(hub_online, Exception):
        calls = online(monkeypatch, fail=hub_online)
    elif hub_online == "fill":
        (tmp_path / "nosafetensors").mkdir()
        shutil.copy(hub.src.binonly / "config.json", tmp_path / "nosafetensors" / "config.json")
        calls = online(monkeypatch, fill=tmp_path / "nosafetensors")
    assert main(argv) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert named in last and last.startswith(f"rlengine {argv[0]}: error: "), last
    assert len(calls) == (hub_online is not None), calls     # online: the one call, and nothing when offline

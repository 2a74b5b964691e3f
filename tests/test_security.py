"""Security: no unpickling, no remote code unless asked, no request reads another's KV, no network unless asked.

``tests/test_models.py`` already checks that ``load_model`` refuses a directory
holding only a ``pytorch_model.bin``. Here:

* the same through the ``LLM`` front door, with a pickle that would leave a mark
  if it were ever unpickled; a ``.bin`` beside safetensors weights is ignored,
  and ``torch.load`` / ``pickle`` are never called while loading;
* ``trust_remote_code`` is False by default in ``LLM`` and ``load_model`` and is
  handed to transformers as given; a directory whose config points at custom
  code is not run;
* a prefix-cache hit always compares tokens and parents: with a hash function
  that collides on purpose, installed in a real engine, every request still gets
  exactly the tokens of transformers' ``generate()``;
* building an engine from a model in memory or from a local directory and
  generating opens no network connection, even with ``HF_HUB_OFFLINE`` unset.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import socket

import pytest
import torch
from engine_helpers import (
    Reference,
    assert_pool_clean,
    build_llm,
    greedy_params,
    make_model,
    random_prompt,
)

import kvpaging.entrypoints.llm
import kvpaging.models
from kvpaging import LLM
from kvpaging.models import load_model, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

ARCH = "qwen3"
SMALL = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             intermediate_size=128, vocab_size=512)


class LeavesAMark:
    """Unpickling this creates the directory ``path``: proof that the pickle ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def write_evil_pickle(path, mark) -> None:
    with open(path, "wb") as f:
        pickle.dump({"model.embed_tokens.weight": LeavesAMark(str(mark))}, f)


@pytest.fixture
def no_unpickling(monkeypatch):
    """Record every call to torch.load and pickle's loaders (still doing the work, so nothing else breaks)."""
    calls = []

    def spy(name, real):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(torch, "load", spy("torch.load", torch.load))
    monkeypatch.setattr(pickle, "load", spy("pickle.load", pickle.load))
    monkeypatch.setattr(pickle, "loads", spy("pickle.loads", pickle.loads))
    return calls


# --------------------------------------------------------------------------- pickles


def test_llm_refuses_a_directory_with_only_a_pickle_and_never_runs_it(tmp_path, no_unpickling):
    model = tiny(ARCH, **SMALL)
    model.config.save_pretrained(tmp_path)
    mark = tmp_path / "PWNED"
    write_evil_pickle(tmp_path / "pytorch_model.bin", mark)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path), num_blocks=64, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)
    assert not mark.exists()
    assert no_unpickling == []


def test_a_pickle_beside_safetensors_weights_is_never_read(tmp_path, no_unpickling):
    model = tiny(ARCH, **SMALL)
    model.save_pretrained(tmp_path, safe_serialization=True)
    mark = tmp_path / "PWNED"
    write_evil_pickle(tmp_path / "pytorch_model.bin", mark)
    no_unpickling.clear()
    loaded = load_model(tmp_path, dtype=torch.float32)  # the saved dtype, whatever this CPU's default
    llm = LLM(str(tmp_path), num_blocks=64, block_size=4, max_model_len=64)
    assert not mark.exists()
    assert no_unpickling == [], f"called while loading: {no_unpickling}"
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    out = llm.generate([[5, 6, 7]], greedy_params(3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_a_pickle_named_safetensors_is_refused_not_unpickled(tmp_path, no_unpickling):
    tiny(ARCH, **SMALL).config.save_pretrained(tmp_path)
    mark = tmp_path / "PWNED"
    write_evil_pickle(tmp_path / "model.safetensors", mark)
    with pytest.raises(Exception):  # noqa: B017 - whatever safetensors says about a file that is not safetensors
        load_model(tmp_path)
    assert not mark.exists()
    assert no_unpickling == []


# --------------------------------------------------------------------------- remote code


def test_trust_remote_code_is_off_by_default():
    assert inspect.signature(LLM.__init__).parameters["trust_remote_code"].default is False
    assert inspect.signature(load_model).parameters["trust_remote_code"].default is False


@pytest.mark.parametrize("given, expected", [({}, False), ({"trust_remote_code": False}, False),
                                             ({"trust_remote_code": True}, True)])
@pytest.mark.parametrize("where", ["local", "hub"])
def test_trust_remote_code_is_passed_through_as_given(tmp_path, monkeypatch, given, expected, where):
    seen = []
    model = tiny(ARCH, **SMALL)

    def fake_from_pretrained(source, *args, **kwargs):
        seen.append((source, kwargs))
        return model

    monkeypatch.setattr(kvpaging.models.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    if where == "local":
        model.save_pretrained(tmp_path, safe_serialization=True)
        source = str(tmp_path)
    else:
        source = "some-org/some-model"  # never fetched: from_pretrained is the fake above
    monkeypatch.setattr(kvpaging.entrypoints.llm, "load_tokenizer", lambda *a, **k: None)
    LLM(source, num_blocks=64, block_size=4, max_model_len=64, **given)
    load_model(source, **given)
    assert len(seen) == 2
    for got_source, kwargs in seen:
        assert got_source == source
        assert kwargs.get("trust_remote_code") is expected, kwargs
        assert kwargs.get("use_safetensors") is True, kwargs


def save_word_tokenizer(path) -> None:
    """A word-level tokenizer ("w5 w6" -> [5, 6]) saved beside the weights, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, **{f"w{i}": i for i in range(4, 64)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>").save_pretrained(path)


def tokenizer_kwargs(tmp_path, monkeypatch, **llm_kwargs) -> dict:
    """The keyword arguments LLM(local directory, **llm_kwargs) hands to AutoTokenizer.from_pretrained."""
    from transformers import AutoTokenizer

    tiny(ARCH, **SMALL).save_pretrained(tmp_path, safe_serialization=True)
    save_word_tokenizer(tmp_path)
    seen = []
    real = AutoTokenizer.from_pretrained

    def spy(source, *args, **kwargs):
        seen.append(kwargs)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    LLM(str(tmp_path), num_blocks=64, block_size=4, max_model_len=64, **llm_kwargs)
    assert len(seen) == 1
    return seen[0]


def test_the_tokenizer_is_loaded_without_remote_code_by_default(tmp_path, monkeypatch):
    assert tokenizer_kwargs(tmp_path, monkeypatch).get("trust_remote_code", False) is False


def test_trust_remote_code_reaches_the_tokenizer_too(tmp_path, monkeypatch):
    assert tokenizer_kwargs(tmp_path, monkeypatch, trust_remote_code=True).get("trust_remote_code") is True


def test_custom_tokenizer_code_in_a_local_directory_is_not_run(tmp_path):
    tiny(ARCH, **SMALL).save_pretrained(tmp_path, safe_serialization=True)
    save_word_tokenizer(tmp_path)
    mark = tmp_path / "PWNED"
    (tmp_path / "tokenization_evil.py").write_text(
        f"import os\nos.makedirs({str(mark)!r}, exist_ok=True)\n"
        "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
    )
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}, tokenizer_class="EvilTokenizer")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    try:
        LLM(str(tmp_path), num_blocks=64, block_size=4, max_model_len=64)
    except Exception:  # noqa: BLE001 - refusing is fine; running the code is not
        pass
    assert not mark.exists(), "custom tokenizer code from the model directory ran without trust_remote_code"


@pytest.mark.parametrize("model_type", ["kvpaging_evil", "qwen3"])
def test_custom_code_in_a_local_directory_is_not_run(tmp_path, model_type):
    """A config whose auto_map points at Python files beside it: without trust_remote_code they never run."""
    model = tiny(ARCH, **SMALL)
    model.save_pretrained(tmp_path, safe_serialization=True)
    mark = tmp_path / "PWNED"
    code = f"import os\nos.makedirs({str(mark)!r}, exist_ok=True)\n"
    (tmp_path / "configuration_evil.py").write_text(code + "from transformers import Qwen3Config as EvilConfig\n")
    (tmp_path / "modeling_evil.py").write_text(code + "from transformers import Qwen3ForCausalLM as EvilForCausalLM\n")
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if model_type == "qwen3":  # a known architecture: transformers' own class, the files beside it ignored
        llm = LLM(str(tmp_path), num_blocks=64, block_size=4, max_model_len=64)
        assert type(llm.engine.model).__name__ == "Qwen3ForCausalLM"
        load_model(tmp_path)
    else:  # only the custom code could build it: refused, naming the way to allow it
        with pytest.raises(ValueError, match="trust_remote_code"):
            LLM(str(tmp_path), num_blocks=64, block_size=4, max_model_len=64)
        with pytest.raises(ValueError, match="trust_remote_code"):
            load_model(tmp_path)
    assert not mark.exists(), "custom code from the model directory ran without trust_remote_code"


# --------------------------------------------------------------------------- prefix cache collisions


@pytest.fixture(scope="module")
def ref(one_thread) -> Reference:
    return Reference(ARCH)


def colliding_llm(hash_fn):
    llm = build_llm(make_model(ARCH), block_size=4, num_blocks=64, max_model_len=64, enable_prefix_caching=True)
    # Installed right after construction: the block manager reads the attribute on every lookup and caching.
    llm.engine.block_manager.hash_fn = hash_fn
    return llm


def run_one_by_one(llm, prompts, num_tokens):
    """One request at a time, so each finds what the earlier ones left in the cache."""
    return [llm.generate([p], greedy_params(num_tokens), use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_every_block_hashing_to_zero_serves_no_one_else_s_kv(ref):
    x, y, z = (random_prompt(4, seed=s) for s in (301, 302, 303))
    tail = random_prompt(3, seed=304)
    prompts = [x + y + tail, x + y + tail, z + y + tail, x + z + tail, y + x + tail, z + x + y + tail]
    llm = colliding_llm(lambda parent, toks: 0)
    outs = run_one_by_one(llm, prompts, 6)
    for i, (p, got) in enumerate(zip(prompts, outs)):
        ref.assert_greedy(p, got, 6, what=f"prompt {i}")
    # one hash means one cached block at a time: the repeat finds X (4 tokens); then Y, Z, X ... mismatch
    assert llm.engine.block_manager.stats().prefix_hit_tokens >= 4
    assert_pool_clean(llm)


def test_a_hash_that_ignores_the_parent_cannot_splice_prefixes(ref):
    """Equal blocks after different prefixes collide; the hit must be refused because the parent differs.

    A = X + Y and D = X2 + W are cached; then B = X2 + Y finds X2 (a true hit) and
    a cached Y under the same hash and with the same tokens -- but computed after
    X, not X2. Serving it would give B keys and values that attended to X.
    """
    x, x2, y, w = (random_prompt(4, seed=s) for s in (311, 312, 313, 314))
    tail = random_prompt(2, seed=315)
    a, d, b = x + y + tail, x2 + w + tail, x2 + y + tail
    llm = colliding_llm(lambda parent, toks: hash(toks))
    bm = llm.engine.block_manager
    outs = run_one_by_one(llm, [a, d], 5)
    hits_before = bm.stats().prefix_hit_tokens
    (got,) = run_one_by_one(llm, [b], 5)
    assert bm.stats().prefix_hit_tokens - hits_before == 4  # X2 only, never the spliced Y
    for p, tokens in zip([a, d, b], outs + [got]):
        ref.assert_greedy(p, tokens, 5)
    assert_pool_clean(llm)


def test_colliding_hashes_with_requests_in_flight_together(ref):
    """The same, with every request in one batch: duplicates computed in the same step are merged by token checks."""
    blocks = [random_prompt(4, seed=s) for s in range(320, 326)]
    prompts = [blocks[i] + blocks[j] + blocks[k][:2] for i, j, k in
               [(0, 1, 2), (1, 0, 2), (0, 1, 3), (2, 1, 0), (0, 2, 1), (0, 1, 2), (3, 4, 5), (4, 3, 5)]]
    for hash_fn in (lambda parent, toks: 0, lambda parent, toks: hash(toks), lambda parent, toks: sum(toks) % 2):
        llm = colliding_llm(hash_fn)
        outs = llm.generate(prompts, greedy_params(5), use_tqdm=False)
        outs += llm.generate(prompts[::-1], greedy_params(5), use_tqdm=False)
        for p, o in zip(prompts + prompts[::-1], outs):
            ref.assert_greedy(p, o.outputs[0].token_ids, 5)
        assert_pool_clean(llm)


# --------------------------------------------------------------------------- network


@pytest.fixture
def no_network(monkeypatch):
    """Online mode as far as the hub libraries know, and every way out of the machine raises."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    attempts = []

    def refuse(what):
        def raiser(*args, **kwargs):
            attempts.append((what, args[1:2] if what == "connect" else args[:1]))
            raise OSError(f"test: network access attempted ({what})")

        return raiser

    monkeypatch.setattr(socket.socket, "connect", refuse("connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("connect_ex"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    return attempts


def test_the_network_guard_itself_works(no_network):
    with pytest.raises(OSError, match="network access attempted"):
        socket.create_connection(("huggingface.co", 443), timeout=1)
    assert no_network


def test_an_in_memory_model_needs_no_network(no_network):
    llm = LLM(tiny(ARCH, **SMALL), num_blocks=64, block_size=4, max_model_len=64)
    out = llm.generate([[5, 6, 7], [8, 9]], greedy_params(4), use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert no_network == []


def test_a_local_directory_with_a_tokenizer_needs_no_network(tmp_path, no_network):
    tiny(ARCH, **SMALL).save_pretrained(tmp_path, safe_serialization=True)
    save_word_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), num_blocks=64, block_size=4, max_model_len=64)
    assert llm.tokenizer is not None
    out = llm.generate(["w5 w6 w7"], greedy_params(4), use_tqdm=False)[0]
    assert out.prompt_token_ids == [5, 6, 7] and len(out.outputs[0].token_ids) == 4
    assert no_network == []


def test_a_hub_id_is_the_one_thing_that_goes_online(no_network, monkeypatch):
    """The positive control: the guard does see the hub client's traffic, so the tests above can fail."""
    import time

    monkeypatch.setattr(time, "sleep", lambda seconds: None)  # the hub client backs off between retries
    with pytest.raises(Exception):  # noqa: B017 - whichever error the hub client makes of a refused connection
        load_model("kvpaging-tests/no-such-model")
    assert no_network, "loading a hub id made no network attempt the guard could see"


def test_an_empty_api_key_flag_never_switches_the_key_off():
    """`--api-key "$UNSET"` gives an empty flag: the environment's key stays, and with none it is an error."""
    from kvpaging.entrypoints.serve import create_app, resolve_api_key

    assert resolve_api_key(None, {"KVPAGING_API_KEY": "env-key"}) == "env-key"
    assert resolve_api_key("", {"KVPAGING_API_KEY": "env-key"}) == "env-key"
    assert resolve_api_key("flag-key", {"KVPAGING_API_KEY": "env-key"}) == "flag-key"
    assert resolve_api_key(None, {}) is None
    with pytest.raises(SystemExit, match="--api-key is empty"):
        resolve_api_key("", {})
    with pytest.raises(ValueError, match="api_key is empty"):
        create_app(object(), api_key="")

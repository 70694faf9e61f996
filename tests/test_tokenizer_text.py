"""The torch-free tokenizer against transformers on the same files, and streaming text."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common.tokenizer import IncrementalDetokenizer, TextTokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["Hello world", " leading space", "two  spaces\tand\ttabs\n\nnewlines",
         "emoji 😀🎉👩‍👩‍👧 and CJK 中文字符 テスト 한국어", "<|im_start|>user\nhi<|im_end|>",
         "café naïve — “quotes” ∑∫√", "", "x" * 300, "   "]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 😀 中文?"}],
    [{"role": "user", "content": ""}],
]


@pytest.fixture(scope="module")
def ours(tok_dir):
    return TextTokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def theirs(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style tokenizer: spaces live at the start of tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there",
              "stream the tokens one by one", "spaces  between   words"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    return TextTokenizer(tok, special_tokens={"bos_token": "<s>", "eos_token": "</s>",
                                              "unk_token": "<unk>"})


def test_export_is_cached_atomic_and_reused(tok_dir, tmp_path):
    from services.engine.tokenizer_export import tokenizer_dir_for

    cache = tok_dir.parent
    assert tok_dir.parent.name == "tokenizers" and (tok_dir / "tokenizer.json").is_file()
    assert [p.name for p in cache.iterdir()] == [tok_dir.name]  # no staging left behind
    env = {**os.environ, "PDSERVE_CACHE": str(cache.parent)}
    out = subprocess.run([sys.executable, "-m", "services.engine.tokenizer_export",
                          "smollm2-135m-instruct"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == str(tok_dir)
    # A Hugging Face directory that has tokenizer.json is used in place.
    assert tokenizer_dir_for(tok_dir) == tok_dir.resolve()
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        tokenizer_dir_for(str(tmp_path / "no-such-model"))


def test_encode_matches_transformers(ours, theirs):
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == \
            theirs.encode(text, add_special_tokens=False), text
    assert ours.vocab_size == len(theirs)
    assert ours.eos_token_id == theirs.eos_token_id == 2


def test_bos_follows_tokenizer_json_like_transformers(tok_dir, tmp_path):
    """SmolLM2 adds no BOS. transformers 5 ignores the config's add_bos_token when
    tokenizer.json exists (its post-processor decides), and so must we."""
    from transformers import AutoTokenizer

    copy = tmp_path / "bos"
    shutil.copytree(tok_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    ours, theirs = TextTokenizer.from_dir(copy), AutoTokenizer.from_pretrained(str(copy))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
    assert ours.encode("Hello") == [19556]
    # A tokenizer.json whose post-processor adds BOS (Llama's) is followed too.
    theirs.add_bos_token = True  # rewrites the post-processor
    theirs.save_pretrained(str(copy))
    ours, theirs = TextTokenizer.from_dir(copy), AutoTokenizer.from_pretrained(str(copy))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text, add_special_tokens=False) == \
            theirs.encode(text, add_special_tokens=False)
    assert ours.encode("Hello") == [ours.bos_token_id, 19556] == [1, 19556]


def test_decode_matches_transformers(ours, theirs):
    rng = random.Random(0)
    sequences = [ours.encode(t) for t in TEXTS] + [[1, 2, 0] + ours.encode("mid") + [2]]
    sequences += [[rng.randrange(ours.vocab_size) for _ in range(30)] for _ in range(20)]
    for ids in sequences:
        for skip in (True, False):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        ours.decode([ours.vocab_size])


def test_chat_template_matches_transformers(ours, theirs):
    for messages in CHATS:
        for gen in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == theirs.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=gen)
            ids = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            assert ours.encode(text, add_special_tokens=False) == list(ids["input_ids"])


def test_template_environment_matches_transformers(tok_dir, theirs):
    template = ("{{ bos_token }}{{ messages | tojson }}{% for m in messages %}"
                "{% if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
                "{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}\n{% endfor %}"
                "{{ eos_token if add_generation_prompt else '' }}")
    ours = TextTokenizer.from_dir(tok_dir)
    ours.chat_template = template
    messages = [{"role": "user", "content": "é <b> 😀"}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": "never"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="bad role"):
        ours.apply_chat_template([{"role": "bad", "content": ""}])
    escape = TextTokenizer.from_dir(tok_dir)
    escape.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ValueError, match="chat template error"):
        escape.apply_chat_template(messages)


def test_errors_are_explicit(tmp_path, ours):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)
    for bad in (["hi"], [{"role": "user"}], [{"content": "x"}], "hi",
                [{"role": 1, "content": "x"}], [{"role": "user", "content": 3}]):
        with pytest.raises(ValueError, match="messages"):
            ours.apply_chat_template(bad)
    plain = TextTokenizer(Tokenizer(models.BPE()))
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "x"}])


def _stream(tok, ids, rng, prompt=None, skip=True, max_step=3):
    detok = IncrementalDetokenizer(tok, prompt, skip)
    pieces, i = [], 0
    while i < len(ids):
        step = rng.randint(1, max_step)
        pieces.append(detok.push(ids[i:i + step], final=i + step >= len(ids)))
        i += step
    return pieces


def test_incremental_detokenizer_random_sequences(ours, metaspace):
    rng = random.Random(1234)
    for tok in (ours, metaspace):
        for _ in range(300):
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 25))]
            skip = rng.random() < 0.5
            assert "".join(_stream(tok, ids, rng, skip=skip)) == tok.decode(ids, skip), ids


def test_incremental_detokenizer_multibyte_one_token_at_a_time(ours, metaspace):
    rng = random.Random(7)
    texts = TEXTS + ["🎉" * 5 + "中" * 5, "a😀b🎉c👩‍👩‍👧d", "hello world the quick brown fox"]
    for tok in (ours, metaspace):
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False)
            full = tok.decode(ids)
            pieces = _stream(tok, ids, rng, max_step=1)
            assert "".join(pieces) == full
            shown = ""
            for piece in pieces:  # every intermediate state is a clean prefix
                shown += piece
                assert full.startswith(shown)
                assert "\ufffd" not in shown or "\ufffd" in full


def test_split_character_is_held_back(ours):
    ids = ours.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's bytes span several byte-level tokens
    detok = IncrementalDetokenizer(ours)
    assert [detok.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "😀"
    # An unfinished character at the very end is released by the final push.
    tail = IncrementalDetokenizer(ours)
    assert tail.push(ids[:1]) == ""
    assert tail.push([], final=True) == ours.decode(ids[:1]) == "\ufffd"


def test_prompt_context_keeps_leading_space(ours, metaspace):
    for tok in (ours, metaspace):
        prompt = tok.encode("hello there", add_special_tokens=False)
        out = tok.encode(" the world", add_special_tokens=False)
        pieces = _stream(tok, out, random.Random(0), prompt=prompt, max_step=1)
        whole, head = tok.decode(prompt + out), tok.decode(prompt)
        assert "".join(pieces) == whole[len(head):]
        assert "".join(pieces).startswith(" the")

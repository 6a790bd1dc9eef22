"""Incremental detokenization: windowed decode, multi-byte safety, stop strings, the process."""

from __future__ import annotations

import multiprocessing
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rxf.core.detokenizer.detokenizer import DecodeState, Detokenizer, DetokState
from rxf.core.detokenizer.process import run_detokenizer_process
from rxf.core.ipc import codec
from rxf.core.ipc.messages import BatchStrOut, BatchTokenOut, FinishReason, TokenOut, ToTokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PIECES = [
    "Hello",
    " world",
    ",",
    " the",
    " quick brown fox",
    " jumps",
    ".",
    "\n",
    " café",
    " naïve",
    " résumé",
    " déjà vu",
    "你好",
    "，世界",
    "！",
    "中文",
    "分词",
    "测试。",
    "我们喜欢学习",
    " 😀",
    "🎉",
    "👍",
    " are fun",
    " 🚀",
    "Ω≈ç√",
    " END",
    "ENDless",
    " stop",
    "\n\n",
]


def _gpt2_byte_chars() -> dict[int, str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the other bytes
    are shifted to code points from 256 up (the GPT-2 scheme)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars: dict[int, str] = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return chars


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE trained at run time; its vocab is small enough that many Chinese and
    emoji characters stay split into partial UTF-8 byte tokens."""
    rng = random.Random(0)
    corpus = ["".join(rng.choice(PIECES) for _ in range(12)) for _ in range(200)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=380,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
        clean_up_tokenization_spaces=False,
    )


def _byte_ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One token per UTF-8 byte: splits every multi-byte character across tokens."""
    chars = _gpt2_byte_chars()
    return [tok.convert_tokens_to_ids(chars[b]) for b in text.encode()]


def _text_stream(tok: PreTrainedTokenizerFast, rng: random.Random, n_pieces: int) -> list[int]:
    """Token ids of valid text, each piece either BPE-encoded or exploded into byte tokens."""
    ids: list[int] = []
    for _ in range(n_pieces):
        piece = rng.choice(PIECES)
        ids += _byte_ids(tok, piece) if rng.random() < 0.3 else tok.encode(piece)
    return ids


def _chunks(ids: list[int], rng: random.Random, max_chunk: int) -> Iterator[list[int]]:
    i = 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        yield ids[i : i + n]
        i += n


def _stream(tok: Any, ids: list[int], rng: random.Random, max_chunk: int = 5, skip: bool = True) -> list[str]:
    """Feed `ids` to a DecodeState in random chunks (the last one finished); return the deltas."""
    state = DecodeState()
    chunks = list(_chunks(ids, rng, max_chunk))
    if rng.random() < 0.3:
        chunks.append([])  # finished with no new tokens (e.g. an abort)
    return [
        state.step(tok, chunk, skip_special_tokens=skip, finished=i == len(chunks) - 1)
        for i, chunk in enumerate(chunks)
    ]


def test_tokenizer_splits_multibyte_characters(tok: PreTrainedTokenizerFast) -> None:
    partial = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    assert len(partial) > 100  # lone bytes and byte pairs of Chinese/emoji characters
    ids = tok.encode("你好，世界！😀 déjà vu 中文分词")
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # BPE itself splits some characters


def test_empty_stream(tok: PreTrainedTokenizerFast) -> None:
    assert DecodeState().step(tok, [], finished=True) == "" == tok.decode([])


@pytest.mark.parametrize("seed", range(40))
def test_text_streams_match_full_decode(tok: PreTrainedTokenizerFast, seed: int) -> None:
    rng = random.Random(seed)
    ids = _text_stream(tok, rng, rng.randint(1, 30))
    full = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in full
    deltas = _stream(tok, ids, rng)
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("skip", [True, False])
def test_random_id_streams_match_full_decode(tok: PreTrainedTokenizerFast, seed: int, skip: bool) -> None:
    # Arbitrary ids (special tokens, invalid UTF-8 included): the deltas still add up exactly.
    rng = random.Random(1000 + seed)
    ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 60))]
    assert "".join(_stream(tok, ids, rng, skip=skip)) == tok.decode(ids, skip_special_tokens=skip)


class RecordingTokenizer:
    """Delegates to a real tokenizer and records the length of every decoded sequence."""

    def __init__(self, tok: PreTrainedTokenizerFast) -> None:
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kwargs)


@pytest.mark.parametrize("max_chunk", [1, 4])
def test_decode_window_stays_small(tok: PreTrainedTokenizerFast, max_chunk: int) -> None:
    rng = random.Random(7)
    ids: list[int] = []
    while len(ids) < 500:
        ids += _text_stream(tok, rng, 10)
    rec = RecordingTokenizer(tok)
    deltas = _stream(rec, ids, rng, max_chunk=max_chunk)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    # A window is the last confirmed chunk plus the pending tokens. One token at a time, that is at
    # most 4 + 4 (an emoji exploded into byte tokens). In random chunks, a run of byte tokens stays
    # pending until a chunk happens to end on a character boundary: still a few chunks, whatever
    # the output length. Re-decoding everything would cost ~len(ids)**2 / 2 / chunk tokens in all.
    assert max(rec.lengths) <= (8 if max_chunk == 1 else 48)
    assert sum(rec.lengths) <= 8 * len(ids)


def _out(rid: str, ids: list[int], finished: FinishReason | None = None, **kw: Any) -> TokenOut:
    return TokenOut(
        rid=rid,
        new_token_ids=ids,
        finished=finished,
        prompt_tokens=3,
        completion_tokens=len(ids),
        cached_tokens=0,
        **kw,
    )


def _detok_stream(
    tok: Any, chunks: list[list[int]], stop: list[str], finish: FinishReason, no_stop_trim: bool = False
) -> list[str]:
    """Feed chunks through a DetokState as the Detokenizer does; the last chunk carries `finish`."""
    state = DetokState()
    deltas = []
    for i, chunk in enumerate(chunks):
        done = finish if i == len(chunks) - 1 else None
        out = _out("r", chunk, done, stop=stop, no_stop_trim=no_stop_trim)
        state.decode.step(tok, chunk, finished=done is not None)
        deltas.append(state.emit(out))
    return deltas


def _assert_prefixes(deltas: list[str], final: str) -> None:
    """What the client has seen at each step is a prefix of the final text: nothing is taken back."""
    seen = ""
    for d in deltas:
        seen += d
        assert final.startswith(seen), (seen, final)
    assert seen == final


def test_stop_string_split_across_tokens_is_held_back_and_trimmed(tok: PreTrainedTokenizerFast) -> None:
    stop = "中文😀"
    ids = tok.encode("Hello 你好") + _byte_ids(tok, stop + " after")
    deltas = _detok_stream(tok, [[i] for i in ids], [stop], FinishReason(type="stop", matched=stop))
    _assert_prefixes(deltas, "Hello 你好")
    assert all(not d or "中" not in d for d in deltas)


def test_no_stop_trim_keeps_the_stop_string(tok: PreTrainedTokenizerFast) -> None:
    stop = "中文😀"
    ids = tok.encode("Hello 你好") + _byte_ids(tok, stop + " after")
    finish = FinishReason(type="stop", matched=stop)
    deltas = _detok_stream(tok, [[i] for i in ids], [stop], finish, no_stop_trim=True)
    _assert_prefixes(deltas, "Hello 你好中文😀 after")


def test_stop_prefix_is_released_when_it_does_not_complete(tok: PreTrainedTokenizerFast) -> None:
    ids = _byte_ids(tok, "the ENDless story")
    length = FinishReason(type="length")
    deltas = _detok_stream(tok, [[i] for i in ids], ["END!"], length)
    _assert_prefixes(deltas, "the ENDless story")
    seen = "".join(deltas[: len("the EN")])  # after the token that completes "the EN"
    assert seen == "the "
    # A prefix of a stop string still pending at the end (finish by length) is flushed.
    _assert_prefixes(_detok_stream(tok, [_byte_ids(tok, "a EN")], ["END"], length), "a EN")


def test_complete_stop_string_before_finish_is_held_back(tok: PreTrainedTokenizerFast) -> None:
    # The scheduler's finish may come a step after the detokenizer first sees the stop string.
    first, second = tok.encode("abc END xyz"), tok.encode(" more")
    deltas = _detok_stream(tok, [first, second], ["END"], FinishReason(type="stop", matched="END"))
    assert deltas == ["abc ", ""]


@pytest.mark.parametrize("seed", range(30))
def test_random_stop_strings(tok: PreTrainedTokenizerFast, seed: int) -> None:
    """Simulate the scheduler: it finishes on the first token whose decoded prefix contains a stop
    string; the client must see exactly the text before that stop string, never any of it."""
    rng = random.Random(5000 + seed)
    stops = rng.sample(["中文", "😀🎉", "END", " world", "\n\n", "é v", "分词测"], k=rng.randint(1, 3))
    ids = _text_stream(tok, rng, 25)
    end, matched = len(ids), None
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1])
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            end, matched = i + 1, min(hits)[1]
            break
    ids = ids[:end]
    full = tok.decode(ids)
    finish = FinishReason(type="stop", matched=matched) if matched else FinishReason(type="length")
    for no_trim in (False, True):
        expected = full if (no_trim or matched is None) else full[: full.find(matched)]
        deltas = _detok_stream(tok, list(_chunks(ids, rng, 4)), stops, finish, no_stop_trim=no_trim)
        _assert_prefixes(deltas, expected)


@pytest.mark.parametrize("recording", [False, True])
def test_detokenizer_interleaved_requests(tok: PreTrainedTokenizerFast, recording: bool) -> None:
    # recording=False takes the Rust batch path; True the one-decode-per-window path.
    rng = random.Random(11)
    detok = Detokenizer(RecordingTokenizer(tok) if recording else tok)
    streams = {
        f"r{i}": (
            [rng.randrange(len(tok)) for _ in range(rng.randint(0, 40))]
            if i % 3 == 0
            else _text_stream(tok, rng, 15)
        )
        for i in range(12)
    }
    skip = {rid: i % 2 == 0 for i, rid in enumerate(streams)}
    pending = {rid: list(_chunks(ids, rng, 5)) or [[]] for rid, ids in streams.items()}
    got = {rid: "" for rid in streams}
    while pending:
        batch = []
        for rid in rng.sample(sorted(pending), k=rng.randint(1, len(pending))):
            # Sometimes the same request twice in one batch.
            for _ in range(rng.choice([1, 1, 1, 2])):
                if not pending.get(rid):
                    break
                chunk = pending[rid].pop(0)
                done = FinishReason(type="length") if not pending[rid] else None
                batch.append(_out(rid, chunk, done, skip_special_tokens=skip[rid]))
                if done:
                    del pending[rid]
        result = detok.handle(BatchTokenOut(outs=batch))
        assert [o.token for o in result.outs] == batch
        for o in result.outs:
            got[o.token.rid] += o.text_delta
    assert detok.num_active == 0
    for rid, ids in streams.items():
        assert got[rid] == tok.decode(ids, skip_special_tokens=skip[rid]), rid


def test_detokenizer_process(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    tok.save_pretrained(tmp_path / "tok")
    recv_addr, send_addr = f"ipc://{tmp_path}/to_detok", f"ipc://{tmp_path}/from_detok"
    mp = multiprocessing.get_context("spawn")
    parent_conn, child_conn = mp.Pipe(duplex=False)
    proc = mp.Process(
        target=run_detokenizer_process,
        args=(str(tmp_path / "tok"), recv_addr, send_addr, child_conn),
        daemon=True,
    )
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(send_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(recv_addr)
    proc.start()
    try:
        assert parent_conn.poll(60), "detokenizer did not report ready"
        assert parent_conn.recv() == "ready"
        a, b = tok.encode("你好，世界！"), _byte_ids(tok, "😀 café")
        push.send(b"not a message")  # logged and dropped: the process keeps serving
        push.send(codec.encode(BatchTokenOut(outs=[_out("a", a[:2]), _out("b", b, FinishReason(type="length"))])))
        assert pull.poll(20_000), "no reply from the detokenizer"
        reply = codec.Decoder(ToTokenizer).decode(pull.recv())
        assert isinstance(reply, BatchStrOut)
        assert [(o.token.rid, o.text_delta) for o in reply.outs] == [
            ("a", DecodeState().step(tok, a[:2])),
            ("b", "😀 café"),
        ]
        t0 = time.monotonic()
        proc.terminate()
        proc.join(10)
        assert proc.exitcode == 0
        assert time.monotonic() - t0 < 3
    finally:
        if proc.is_alive():
            proc.kill()
        ctx.destroy(linger=0)


def test_detokenizer_process_reports_a_bad_tokenizer(tmp_path: Path) -> None:
    mp = multiprocessing.get_context("spawn")
    parent_conn, child_conn = mp.Pipe(duplex=False)
    args = (str(tmp_path / "missing"), f"ipc://{tmp_path}/a", f"ipc://{tmp_path}/b", child_conn)
    proc = mp.Process(target=run_detokenizer_process, args=args, daemon=True)
    proc.start()
    try:
        assert parent_conn.poll(60)
        msg = parent_conn.recv()
        assert isinstance(msg, dict) and "missing" in msg["error"]
        proc.join(10)
        assert proc.exitcode not in (0, None)
    finally:
        if proc.is_alive():
            proc.kill()

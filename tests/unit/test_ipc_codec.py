"""The codec between rxf's processes (`rxf.core.ipc.codec`): every message comes back as what was
sent, typed, through the union its receiver decodes with; anything else is refused; tensors in
`MultimodalItem.data` travel as dtype, shape and bytes, decoded in place from a writable buffer."""

from __future__ import annotations

import pickle
import typing
import warnings

import msgspec
import numpy as np
import pytest
import torch

from rxf.core.ipc import codec
from rxf.core.ipc.messages import (
    AbortReq,
    AdminReply,
    AdminResult,
    BatchStrOut,
    BatchTokenOut,
    FinishReason,
    FlushCacheReq,
    GetStatsReq,
    MultimodalItem,
    PreparedRequest,
    ProfileReq,
    RankBroadcast,
    RequestOptions,
    SchedulerStats,
    StatsReply,
    StatsSnapshot,
    StrOut,
    ToDetokenizer,
    TokenOut,
    ToScheduler,
    ToTokenizer,
)
from rxf.core.sampling_params import SamplingParams

PARAMS = SamplingParams.from_dict(
    {"max_new_tokens": 7, "temperature": 0.5, "seed": 2**64 - 1, "stop": ["\n\n"], "logit_bias": {"5": -2.5},
     "json_schema": '{"type": "object"}'}
)
TOKEN = TokenOut(
    "r-1", [4, 5], FinishReason("stop", "\n\n"), 3, 2, 1, stop=["\n\n"], no_stop_trim=True,
    output_token_logprobs=[-0.5, -1.0], output_top_logprobs=[[(4, -0.5)], [(5, -1.0), (6, -2.0)]],
    input_token_logprobs=[None, -3.0], input_top_logprobs=[[], [(7, -3.0)]], input_token_ids=[1, 2],
)
STATS = SchedulerStats(1, 2, 100, 50, 30, 20, 0.25, {"retractions": 3, "new_token_ratio": 0.5})

# One of every message each kind of socket receives, with its fields away from their defaults.
SENT = {
    ToScheduler: [
        PreparedRequest("r-1", [1, 2, 3], PARAMS, RequestOptions(True, True, 0, 2, "salt", -4)),
        AbortReq("r-1"),
        FlushCacheReq(7),
        GetStatsReq(8),
        ProfileReq(9, True, "20261203-080000-abc123", 40, True),
    ],
    ToDetokenizer: [BatchTokenOut([TOKEN, TokenOut("r-2", [], None, 1, 0, 0)])],
    ToTokenizer: [
        BatchStrOut([StrOut(TOKEN, "héllo 🌍")]),
        StatsSnapshot(1, STATS),
        StatsReply(8, STATS),
        AdminReply(7, AdminResult(False, "requests are running")),
    ],
}


def test_every_message_type_has_a_receiver():
    members = {t for union in SENT for t in typing.get_args(union) or (union,)}
    assert members == {type(m) for sent in SENT.values() for m in sent}


@pytest.mark.parametrize("accepts", list(SENT), ids=lambda u: str(u))
def test_messages_come_back_typed_and_equal(accepts):
    decoder = codec.Decoder(accepts)
    for msg in SENT[accepts]:
        back = decoder.decode(codec.encode(msg))
        assert type(back) is type(msg) and back == msg


def test_a_receiver_refuses_other_messages_and_garbage():
    with pytest.raises(msgspec.ValidationError):
        codec.Decoder(ToScheduler).decode(codec.encode(BatchTokenOut([TOKEN])))
    with pytest.raises(msgspec.ValidationError):  # a field of the wrong type
        codec.Decoder(ToScheduler).decode(msgspec.msgpack.encode(["AbortReq", 5]))
    with pytest.raises(msgspec.DecodeError):
        codec.Decoder(ToTokenizer).decode(b"\xc1 not msgpack")
    with pytest.raises(msgspec.DecodeError):  # a pickle is not a message
        codec.Decoder(ToScheduler).decode(pickle.dumps(AbortReq("r")))


TENSORS = [
    torch.randn(2, 3, 4),
    torch.randn(3, 5).to(torch.bfloat16),
    torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),  # not contiguous
    torch.tensor([True, False, True]),
    torch.tensor(2.5, dtype=torch.float16),  # 0-d
    torch.zeros(0, 3, dtype=torch.uint8),  # empty
]


@pytest.mark.parametrize("tensor", TENSORS, ids=lambda t: f"{t.dtype}{list(t.shape)}")
def test_tensors_keep_dtype_shape_and_values(tensor):
    item = MultimodalItem("image", 2**64 - 1, 2, 3, {"pixel_values": tensor, "image_size": (336, 672)})
    sent = PreparedRequest("r", [1, 2, 3, 4, 5], PARAMS, mm_items=[item])
    back = codec.Decoder(ToScheduler).decode(bytearray(codec.encode(sent)))
    got = back.mm_items[0].data["pixel_values"]
    assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)
    assert back.mm_items[0].data["image_size"] == [336, 672] and back.mm_items[0].hash == 2**64 - 1


def test_a_tensor_is_decoded_in_place_from_a_writable_buffer_and_copied_from_bytes():
    pixels = torch.randn(1, 3, 64, 64)
    data = codec.encode(PreparedRequest("r", [1], PARAMS, mm_items=[MultimodalItem("image", 1, 0, 1, {"p": pixels})]))
    buf = bytearray(data)
    decoder = codec.Decoder(ToScheduler)
    view = decoder.decode(buf).mm_items[0].data["p"]
    start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert start <= view.data_ptr() < start + len(buf)  # a view of the received message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "non-writable buffer" warning from torch
        copy = decoder.decode(data).mm_items[0].data["p"]
    copy += 1  # its own memory: the message is untouched
    assert torch.equal(view, pixels) and torch.equal(copy, pixels + 1)


def test_what_cannot_be_sent_is_refused_at_the_sender():
    for value, what in [(np.zeros(2), "ndarray"), (object(), "object"), (torch.zeros(2, dtype=torch.complex64), "complex64")]:
        item = MultimodalItem("image", 1, 0, 1, {"x": value})
        with pytest.raises(TypeError, match=what):
            codec.encode(PreparedRequest("r", [1], PARAMS, mm_items=[item]))


def test_rank_broadcast_carries_frames_as_views():
    frames = [codec.encode(AbortReq("a")), codec.encode(GetStatsReq(1))]
    shared = codec.Decoder(RankBroadcast).decode(bytearray(codec.encode(RankBroadcast(frames))))
    decoder = codec.Decoder(ToScheduler)
    assert [decoder.decode(f) for f in shared.frames] == [AbortReq("a"), GetStatsReq(1)] and not shared.stop

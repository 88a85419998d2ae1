"""Writes KV-event batches with msgspec, the encoder vLLM uses, in the struct layouts of
several vLLM releases (definitions written from docs/simulator.md, "vLLM's KV-event wire
format"), one JSON line per case: {"name", "payload_hex", "expected"}. The Rust test decodes
each payload and compares.
"""

import hashlib
import json
import sys
from typing import Any

import msgspec

U64_MASK = (1 << 64) - 1


def layouts():
    """Struct definitions per release: name -> (EventBatch, BlockStored, BlockRemoved, AllBlocksCleared)."""
    result = {}

    # 0.9.0: no rank, no medium, python-int hashes.
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]

    class AllBlocksCleared(KVCacheEvent):
        pass

    result["0.9.0"] = (EventBatch, BlockStored, BlockRemoved, AllBlocksCleared)

    # 0.10.2: rank, medium.
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    result["0.10.2"] = (EventBatch, BlockStored, BlockRemoved, AllBlocksCleared)

    # 0.22 with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: raw digests as bin.
    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes]
        parent_block_hash: bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    result["0.22-bin"] = (EventBatch, BlockStored, BlockRemoved, AllBlocksCleared)

    # 0.33: maps, locality, ownership, session_id, lookahead_token_ids.
    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None
        lookahead_token_ids: list[int] | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    result["0.33"] = (EventBatch, BlockStored, BlockRemoved, AllBlocksCleared)
    return result


def wire_hash(value):
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return value & U64_MASK


def expected_event(event):
    tag = type(event).__name__
    out = {"tag": tag}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if name == "block_hashes":
            value = [wire_hash(h) for h in value]
        elif name == "parent_block_hash" and value is not None:
            value = wire_hash(value)
        elif name in ("extra_keys", "ownership", "session_id", "lookahead_token_ids"):
            continue
        out[name] = value
    return out


def main():
    structs = layouts()
    encoder = msgspec.msgpack.Encoder()
    cases = []

    batch, stored, removed, cleared = structs["0.9.0"]
    cases.append((
        "0.9.0 python-int hashes",
        batch(ts=1717171717.25, events=[
            stored(block_hashes=[-(2**63), -1, 2**63 - 1], parent_block_hash=-42,
                   token_ids=[1, 2, 3, 4, 5, 6], block_size=2, lora_id=None),
            removed(block_hashes=[-7]),
            cleared(),
        ]),
    ))

    batch, stored, removed, cleared = structs["0.10.2"]
    cases.append((
        "0.10.2 u64 hashes",
        batch(ts=1757000000.5, data_parallel_rank=3, events=[
            stored(block_hashes=[2**64 - 1, 5], parent_block_hash=None,
                   token_ids=[0, 127, 128, 65535, 65536, 2**32 - 1], block_size=3, lora_id=7,
                   medium="GPU"),
            removed(block_hashes=[2**64 - 1], medium="CPU"),
        ]),
    ))

    batch, stored, removed, cleared = structs["0.22-bin"]
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    cases.append((
        "0.22 bin32 hashes",
        batch(ts=1760000000.0, data_parallel_rank=0, events=[
            stored(block_hashes=digests[1:], parent_block_hash=digests[0], token_ids=[9] * 32,
                   block_size=16, lora_id=None, medium="GPU", lora_name="adapter",
                   extra_keys=[("mm", 3, b"\x00"), None], group_idx=1,
                   kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096),
            removed(block_hashes=[digests[2]], medium="GPU", group_idx=1),
        ]),
    ))

    batch, stored, removed, cleared = structs["0.33"]
    cases.append((
        "0.33 maps with locality",
        batch(ts=1780000000.75, data_parallel_rank=1, events=[
            stored(block_hashes=[11, 12], parent_block_hash=10, token_ids=list(range(8)),
                   block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                   kv_cache_spec_kind="full_attention", locality="REMOTE", ownership="peer",
                   session_id="session-1", lookahead_token_ids=[8, 9]),
            removed(block_hashes=[11], medium="GPU", group_idx=0, locality="LOCAL",
                    ownership="self"),
            cleared(),
        ]),
    ))

    for name, value in cases:
        payload = encoder.encode(value)
        expected = {
            "ts": value.ts,
            "data_parallel_rank": getattr(value, "data_parallel_rank", None),
            "events": [expected_event(event) for event in value.events],
        }
        print(json.dumps({"name": name, "payload_hex": payload.hex(), "expected": expected}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()

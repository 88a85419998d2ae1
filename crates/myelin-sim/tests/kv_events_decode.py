#!/usr/bin/env python3
"""Independent decoder for the simulator's KV-event stream, used by tests/kv_events.rs.

Written from vLLM's published struct definitions (msgspec) and its ZMQ protocol, not from the
simulator's code: a SUB socket for live batches and a DEALER for replay. Reads commands on
stdin, prints one JSON object per command on stdout:
  collect N     -> {"live": [message, ...]}       (exactly N live messages, or an error)
  replay START  -> {"replay": [message, ...], "end": {...}}
  quit
A message is {"topic", "seq", "frames", "ts", "dp_rank", "events": [{"type", fields...,
"raw": layout}]} where "raw" is the array length (0.22) or the sorted map keys (0.33) as sent.
Exits 3 with a message on stderr when pyzmq or msgspec is missing.
"""
import argparse
import json
import sys
import time

try:
    import msgspec
    import zmq
except ImportError as error:  # The Rust test turns this into a clear failure.
    print(f"kv_events_decode.py needs python3 with pyzmq and msgspec: {error}", file=sys.stderr)
    sys.exit(3)

TIMEOUT_MS = 10_000


def event_types(wire):
    """vLLM's KV event structs for one release's layout."""
    array_like = wire == "0.22"
    base = dict(omit_defaults=True, gc=False, tag=True, array_like=array_like)
    if not array_like:
        base["forbid_unknown_fields"] = True

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, **base):
        pass

    if wire == "0.22":
        class BlockStored(KVCacheEvent):
            block_hashes: list[int]
            parent_block_hash: int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[int]
            medium: str | None
            group_idx: int | None = None
    else:
        class BlockStored(KVCacheEvent):
            block_hashes: list[int]
            parent_block_hash: int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list | None = None
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

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch


def describe(topic, seq_bytes, payload, decoder, frames):
    batch = decoder.decode(payload)
    raw = msgspec.msgpack.decode(payload)
    events = []
    for event, raw_event in zip(batch.events, raw[1]):
        fields = msgspec.structs.asdict(event)
        fields["type"] = type(event).__name__
        fields["raw"] = len(raw_event) if isinstance(raw_event, list) else sorted(raw_event)
        events.append(fields)
    return {
        "topic": topic.decode("utf-8") if topic is not None else None,
        "seq": int.from_bytes(seq_bytes, "big", signed=True),
        "frames": frames,
        "ts": batch.ts,
        "dp_rank": batch.data_parallel_rank,
        "batch_len": len(raw),
        "events": events,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sub", required=True)
    parser.add_argument("--replay", required=True)
    parser.add_argument("--wire", choices=["0.22", "0.33"], required=True)
    parser.add_argument("--topic", default="")
    args = parser.parse_args()
    decoder = msgspec.msgpack.Decoder(event_types(args.wire))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode("utf-8"))
    sub.connect(args.sub)
    # Let the subscription reach the publisher before the test produces events.
    time.sleep(0.5)
    print("READY", flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        if command[0] == "quit":
            break
        if command[0] == "collect":
            wanted = int(command[1])
            live = []
            while len(live) < wanted:
                if not sub.poll(TIMEOUT_MS):
                    print(json.dumps({"error": f"timed out after {len(live)} live messages"}), flush=True)
                    break
                frames = sub.recv_multipart()
                topic, seq, payload = frames
                live.append(describe(topic, seq, payload, decoder, len(frames)))
            else:
                print(json.dumps({"live": live}), flush=True)
        elif command[0] == "replay":
            start = int(command[1])
            dealer = context.socket(zmq.DEALER)
            dealer.connect(args.replay)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            replayed = []
            end = None
            while end is None:
                if not dealer.poll(TIMEOUT_MS):
                    end = {"error": "timed out waiting for the end marker"}
                    break
                frames = dealer.recv_multipart()
                if frames[0] != b"":
                    end = {"error": "missing empty delimiter frame"}
                    break
                if args.wire == "0.33":
                    _, topic, seq, payload = frames
                else:
                    _, seq, payload = frames
                    topic = None
                if seq == b"\xff" * 8:
                    end = {"seq": -1, "payload_len": len(payload), "frames": len(frames),
                           "topic": topic.decode("utf-8") if topic is not None else None}
                else:
                    replayed.append(describe(topic, seq, payload, decoder, len(frames)))
            dealer.close(linger=0)
            print(json.dumps({"replay": replayed, "end": end}), flush=True)
    sub.close(linger=0)
    context.term()


if __name__ == "__main__":
    main()

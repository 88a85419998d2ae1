#!/usr/bin/env python3
"""The official OpenAI Python client against a simulated engine (tests/openai_client.rs): the
responses must parse into the client's own types, streams included. Prints OK on success.
Exits 3 with a message on stderr when the openai package is missing."""
import sys

try:
    import openai
except ImportError as error:
    print(f"openai_client.py needs python3 with the openai package: {error}", file=sys.stderr)
    sys.exit(3)


def main():
    client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=30)
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].owned_by == "vllm", models

    reply = client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "Describe the harbour."}],
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    choice = reply.choices[0]
    assert reply.object == "chat.completion", reply
    assert choice.message.role == "assistant" and choice.message.content, reply
    assert choice.finish_reason == "length", reply
    assert reply.usage.completion_tokens == 4, reply.usage

    stream = client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "Describe the harbour."}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip(), chunks
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"], finishes
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 6, chunks[-1]
    # Same prompt as the first chat: its full blocks are cached now.
    assert usage.prompt_tokens_details.cached_tokens > 0 or usage.prompt_tokens < 17, usage

    prompt = " ".join(f"token{i}" for i in range(200))
    first = client.completions.create(model="sim", prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True})
    again = client.completions.create(model="sim", prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True})
    assert first.choices[0].finish_reason == "length", first
    assert first.usage.prompt_tokens_details.cached_tokens == 0, first.usage
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (again.usage.prompt_tokens - 1) // 16 * 16, again.usage
    assert again.choices[0].text == first.choices[0].text

    streamed = client.completions.create(
        model="sim", prompt=prompt, max_tokens=3, stream=True, extra_body={"ignore_eos": True}
    )
    pieces = [c.choices[0].text for c in streamed if c.choices]
    assert "".join(pieces) == first.choices[0].text, pieces
    print("OK")


if __name__ == "__main__":
    main()

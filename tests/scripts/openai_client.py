"""The official `openai` client against a running `thaw serve`, used unchanged.

Usage: openai_client.py BASE_URL MODEL API_KEY
Prints one JSON object with what each call returned; the Rust test judges it.
"""
import json
import sys

import openai

base, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base + "/v1", api_key=key)
out = {}

msgs = [{"role": "user", "content": "What is the capital of France?"}]
r = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
out["chat"] = {
    "text": r.choices[0].message.content,
    "finish_reason": r.choices[0].finish_reason,
    "usage": r.usage.model_dump(),
}

parts, finish, usage = [], None, None
stream = client.chat.completions.create(
    model=model, messages=msgs, max_tokens=24, temperature=0, stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage.model_dump()
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
out["chat_stream"] = {"text": "".join(parts), "finish_reason": finish, "usage": usage,
                      "chunks": len(parts)}

r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                              temperature=0, extra_body={"ignore_eos": True})
out["completion"] = {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                     "usage": r.usage.model_dump()}

r = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                   logprobs=True, top_logprobs=2, n=2)
out["chat_logprobs"] = [
    {"text": c.message.content,
     "tokens": [t.token for t in c.logprobs.content],
     "logprobs": [t.logprob for t in c.logprobs.content],
     "top": [[a.token for a in t.top_logprobs] for t in c.logprobs.content]}
    for c in r.choices
]

r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                              temperature=0, logprobs=2, logit_bias={"7042": -100})
out["completion_logprobs"] = {"text": r.choices[0].text, "tokens": r.choices[0].logprobs.tokens,
                              "top": r.choices[0].logprobs.top_logprobs}

out["models"] = [m.id for m in client.models.list().data]

try:
    client.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=4)
    out["unknown_model"] = "no error"
except openai.NotFoundError as e:
    out["unknown_model"] = e.status_code

print(json.dumps(out))

"""The independent reference: plain greedy decoding with transformers' own model and KV cache."""
import torch


def hf_greedy(model, ids, n):
    """n greedy tokens for prompt ids, one request at a time, EOS not special (as ignore_eos)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            r = model(x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            nxt = int(r.logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    return out

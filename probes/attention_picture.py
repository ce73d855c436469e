"""The picture of an attention-read finding, one schema for both engines (attention_math.picture):
per query head, the attention weights over the context the model means (`want`) and, when an
explanation reproduced the kernel's output, the weights the kernel attended with (`got`).

Our engine keeps the pictures in its attention probe (AttentionCheckProbe.figure); the vLLM plugin
sends one in the finding's evidence (`evidence["picture"]`), so a finding that came over the socket
draws the same way: attention_figure(finding).
"""
from __future__ import annotations

import numpy as np


def weights_figure(pic: dict, heads=None, title: str = "attention weights, want vs got", max_heads: int = 6):
    """A plotly figure of a picture: one row per query head (those named first, at most max_heads),
    want (the model's attention) and got (what reproduces the kernel's output), page boundaries grey."""
    from plotly.subplots import make_subplots
    have = list(pic.get("heads") or range(len(pic["want"])))
    pick = [h for h in (heads or have) if h in have][:max_heads] or have[:max_heads]
    fig = make_subplots(rows=len(pick), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=[f"query head {h}" for h in pick])
    first = int(pic.get("first_key", 0))
    x = first + np.arange(len(pic["want"][0]))
    ps = int(pic.get("page_size") or 0)
    for i, h in enumerate(pick, start=1):
        j = have.index(h)
        fig.add_scatter(x=x, y=pic["want"][j], name="want: the model's attention", row=i, col=1,
                        line=dict(color="#2a9d8f"), showlegend=i == 1)
        if pic.get("got") is not None:
            fig.add_scatter(x=x, y=pic["got"][j], name="got: what reproduces the kernel's output", row=i,
                            col=1, line=dict(color="#e76f51", dash="dot"), showlegend=i == 1)
        if ps:
            for b in range(-(-int(x[0]) // ps) * ps, int(x[-1]) + 1, ps):
                if b > x[0]:
                    fig.add_vline(x=b - 0.5, line=dict(color="#ddd", width=1), row=i, col=1)
    fig.update_xaxes(title_text=f"key position (query at {pic['position']}; grey: page boundaries)",
                     row=len(pick), col=1)
    fig.update_layout(height=170 * len(pick) + 120, title=title, legend=dict(orientation="h"))
    return fig


def attention_figure(finding, pic: dict | None = None):
    """The picture of an attention-read finding: `pic`, or the one its evidence carries (the vLLM
    plugin's `vllm_attention` findings, our engine's first per request and layer); KeyError naming
    the finding when there is none."""
    pic = pic or (finding.evidence or {}).get("picture")
    if not pic:
        raise KeyError(f"finding {finding.kind!r} (request {finding.request_id}, layer {finding.layer}) carries no "
                       f"attention picture: the attention checks attach one to their attention-read findings")
    layer = finding.layer if finding.layer is not None else finding.evidence.get("layer")
    return weights_figure(pic, heads=finding.evidence.get("heads"),
                          title=f"request {finding.request_id}, layer {layer}: attention weights, want vs got")

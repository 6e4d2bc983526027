"""Cost of recording grad_fn records (issue 25): GPT-2 small shape, random weights, 32 tokens.

Interleaves captures with the grad_fn walk on and stubbed off (CPU clock), and reports the walk's own
time as a share of a capture, then the walk plus backward pre-hooks of a backward_ready capture.
Run: .venv/bin/python benchmarks/grad_fn_records.py [ROUNDS]
"""
import os
import statistics as st
import sys
import time

import torch

import torchlens as tl
from transformers import GPT2Config, GPT2LMHeadModel
import torchlens_torch.autograd_records as AR
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config()).eval()
ids = torch.randint(0, 50257, (1, 32))
real = AR.record_grad_fns
spent = []
def timed(*a):
    t0 = time.process_time(); real(*a); spent.append(time.process_time() - t0)
def off(*a):
    pass
tl.trace(model, ids)  # warm
on_t, off_t = [], []
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    for mode in ((timed, on_t), (off, off_t)) if i % 2 == 0 else ((off, off_t), (timed, on_t)):
        AR.record_grad_fns = mode[0]
        t0 = time.process_time(); t = tl.trace(model, ids); mode[1].append(time.process_time() - t0)
        del t
AR.record_grad_fns = real
t = tl.trace(model, ids)
n = len(t.autograd.grad_fns)
import statistics as st
print("load", os.getloadavg())
print("grad_fn nodes", n, "ops", len(t._ops))
print("capture cpu s on (median)", st.median(on_t), "off", st.median(off_t), "ratio", st.median(on_t)/st.median(off_t))
print("record_grad_fns cpu s median", st.median(spent), "share of capture", st.median(spent)/st.median(off_t))
spent.clear(); AR.record_grad_fns = timed
for _ in range(3):
    t0 = time.process_time(); t = tl.trace(model, ids, capture=tl.CaptureOptions(backward_ready=True)); tot = time.process_time() - t0
    print("backward_ready capture cpu s", tot, "record+hooks", spent[-1], "share", spent[-1] / tot)
    l = t.output.logits.sum() if hasattr(t.output, "logits") else t.output[0].sum()
    t.backward(l); print("grad_fn_calls", len(t.autograd.grad_fn_calls))

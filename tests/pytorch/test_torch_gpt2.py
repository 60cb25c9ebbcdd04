"""A real client: a small GPT-2 from `transformers` (random weights, nothing downloaded)
whose blocks run through memento.torch.checkpoint_sequential with dropout on; a few
training steps equal plain autograd's, in float64, with the same seeds."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import memento.torch as mt  # noqa: E402

VOCAB, LENGTH = 64, 12


def model():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=4,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(torch.float64).train()


def first(out):
    """A block's hidden states (older versions return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def loss_of(net, ids, memory):
    t = net.transformer
    h = t.drop(t.wte(ids) + t.wpe(torch.arange(ids.shape[1])))
    blocks = [lambda x, b=b: first(b(x)) for b in t.h]
    if memory is None:
        for block in blocks:
            h = block(h)
    else:
        h = mt.checkpoint_sequential(blocks, h, memory=memory)
    logits = net.lm_head(t.ln_f(h))
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
    )


@pytest.mark.parametrize("memory", [1, 2, "1TiB"])
def test_gpt2_training_steps_equal_plain_autograd(memory):
    plain = model()
    ours = copy.deepcopy(plain)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, ours)]
    data = torch.randint(0, VOCAB, (3, 2, LENGTH), generator=torch.Generator().manual_seed(1))
    for step, ids in enumerate(data):
        losses = []
        for net, opt, mem in zip((plain, ours), opts, (None, memory)):
            torch.manual_seed(100 + step)
            opt.zero_grad()
            loss = loss_of(net, ids, mem)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)

"""``macroarch.integrations.save_pretrained(..., packed=True)``: transformers' own ``from_pretrained`` on the
directory (the model's class and the Auto class) fails at once with an error naming
``macroarch.integrations.from_pretrained``, before it builds a model from any other weights; that function restores
the model exactly; and each form of save removes the other's weights from the directory, so no loader finds the
weights of an earlier save."""

import pytest
import torch
from model_zoo import TokenWindows as Tokens
from model_zoo import tiny_llama
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from macroarch import mvas
from macroarch.integrations import from_pretrained, save_pretrained

NAMED = "load with macroarch.integrations.from_pretrained"


def _logits(model):
    ids = Tokens(16)[0]["input_ids"][None]
    return model(ids).logits


def _restored(model, directory):
    restored, store = from_pretrained(LlamaForCausalLM, directory)
    restored.config._attn_implementation = model.config._attn_implementation
    for name in store:
        assert torch.equal(store.packed(name).payload.view(torch.uint8),
                           model.get_parameter(name).payload.view(torch.uint8)), name
    return restored


@pytest.mark.parametrize("loader", [LlamaForCausalLM, AutoModelForCausalLM], ids=["class", "auto"])
def test_transformers_from_pretrained_on_a_packed_directory_names_the_loader(tmp_path, loader):
    model = tiny_llama(managed=True)
    save_pretrained(model, tmp_path, packed=True)
    with pytest.raises(OSError, match=NAMED):  # FileNotFoundError: transformers' own OSError for missing weights
        loader.from_pretrained(tmp_path)
    assert torch.equal(_logits(_restored(model, tmp_path)), _logits(model))


def test_a_packed_save_over_a_dense_one_leaves_no_dense_weights_to_load(tmp_path):
    model = tiny_llama(managed=True)
    save_pretrained(model, tmp_path)  # dense first: model.safetensors
    assert (tmp_path / "model.safetensors").is_file()
    save_pretrained(model, tmp_path, packed=True)
    assert not (tmp_path / "model.safetensors").exists()
    with pytest.raises(OSError, match=NAMED):  # not the earlier dense weights, silently
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_dense_save_over_a_packed_one_leaves_no_packed_weights_to_load(tmp_path):
    model = tiny_llama(managed=True)
    save_pretrained(model, tmp_path, packed=True)
    (tmp_path / "notes.md").write_text("the user's own")
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".json") == ["model.safetensors", "notes.md"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    dense = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=model.config._attn_implementation)
    assert torch.equal(_logits(dense), _logits(model))
    with pytest.raises(FileNotFoundError, match=r"no MVAS-packed weights.*LlamaForCausalLM\.from_pretrained"):
        from_pretrained(LlamaForCausalLM, tmp_path)
    assert mvas.PACKED_WEIGHTS_NAME not in {p.name for p in tmp_path.iterdir()}

"""Transformers' own common model tests (`CausalLMModelTest`: `ModelTesterMixin`, `GenerationTesterMixin`, the
pipeline, training, tensor-parallel and FSDP mixins), run against the hybrid as a Transformers model's test file
(`tests/models/mistral/test_modeling_mistral.py`) runs them, on CPU.

The mixins live in Transformers' repository, not in its wheel, and they must match the installed version (5.17.0).
PyPI's sdist ships only part of that folder (the top-level `test_*_common.py` and `*_mixin.py` files, but not
`generation/test_utils.py`, `exporters/test_export.py`, `causal_lm_tester.py` or `utils/`), so nothing that CI can
download holds the whole suite (its `utils/test_configuration_utils.py` also imports the repository's top-level
`utils/test_module`): point `TRANSFORMERS_CHECKOUT` at a Transformers checkout at v5.17.0 to run it
(`git clone --depth 1 --branch v5.17.0 https://github.com/huggingface/transformers`, then
`TRANSFORMERS_CHECKOUT=transformers`). Without it those tests are skipped, saying why.

The tests after the common ones need no such folder: they pin what the common suite's static-cache and compile tests
check, on CPU where the SSM branch runs its PyTorch references.
"""

import importlib.util
import os
import sys
import unittest
from pathlib import Path
from unittest import mock

import pytest
import torch
import transformers
from transformers import CompileConfig

from configuration import HybridConfig
from conftest import randomize_, tiny_config
from modeling import (
    HybridForCausalLM,
    HybridForQuestionAnswering,
    HybridForSequenceClassification,
    HybridForTokenClassification,
    HybridModel,
    HybridStaticCache,
)

TRANSFORMERS_TESTS_VERSION = "5.17.0"


def transformers_tests_package():
    """Transformers' `tests` package from the checkout at `TRANSFORMERS_CHECKOUT` (imported under its own name, which
    its modules use: this repository's `tests/` is no package), or the reason it can't be had."""
    if transformers.__version__ != TRANSFORMERS_TESTS_VERSION:
        return None, (
            f"the common tests are pinned to Transformers {TRANSFORMERS_TESTS_VERSION}, not {transformers.__version__}"
        )
    checkout = os.environ.get("TRANSFORMERS_CHECKOUT")
    if not checkout:
        return None, (
            "TRANSFORMERS_CHECKOUT is not set: Transformers' common tests need a Transformers checkout at "
            f"v{TRANSFORMERS_TESTS_VERSION} (PyPI's sdist lacks generation/test_utils.py, exporters/ and "
            "causal_lm_tester.py)"
        )
    folder = Path(checkout).resolve() / "tests"
    if not (folder / "causal_lm_tester.py").is_file():
        return None, f"TRANSFORMERS_CHECKOUT={checkout} has no tests/causal_lm_tester.py (not a Transformers checkout)"
    if importlib.util.find_spec("parameterized") is None:
        return None, "Transformers' common tests need `parameterized` (pip install parameterized)"
    if str(folder.parent) not in sys.path:
        sys.path.append(str(folder.parent))  # its tests import the checkout's top-level `utils` package
    if "tests" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "tests", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules["tests"] = package
        spec.loader.exec_module(package)
    if Path(sys.modules["tests"].__path__[0]).resolve() != folder:
        return None, f"another `tests` package is already imported: {sys.modules['tests'].__path__}"
    return sys.modules["tests"], None


_package, SKIP_REASON = transformers_tests_package()

if _package is not None:
    from transformers.models.auto import modeling_auto

    from tests import test_fsdp_mixin, test_tensor_parallel_mixin
    from tests.causal_lm_tester import CausalLMModelTest, CausalLMModelTester

    MODEL_NAMES = {
        "MODEL_MAPPING_NAMES": "HybridModel",
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": "HybridForCausalLM",
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": "HybridForSequenceClassification",
        "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": "HybridForTokenClassification",
        "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": "HybridForQuestionAnswering",
    }
    DISTRIBUTED_MODEL_TYPES = [
        (test_tensor_parallel_mixin, "TP_DISTRIBUTED_TEST_MODEL_TYPES"),
        (test_fsdp_mixin, "FSDP_DISTRIBUTED_TEST_MODEL_TYPES"),
    ]

    class HybridModelTester(CausalLMModelTester):
        # Named explicitly: the tester infers them only for models inside the `transformers` package.
        base_model_class = HybridModel
        config_class = HybridConfig
        causal_lm_class = HybridForCausalLM
        question_answering_class = HybridForQuestionAnswering
        sequence_classification_class = HybridForSequenceClassification
        token_classification_class = HybridForTokenClassification

        def __init__(self, parent, **kwargs):
            # Both layer kinds (the window, the config's default, is longer than the tests' sequences, as Mistral's:
            # the common checks of cache and attention shapes assume nothing is evicted), a small SSM.
            kwargs.setdefault("layer_types", ["sliding_attention", "full_attention"])
            kwargs.setdefault("ssm_state_size", 4)
            kwargs.setdefault("ssm_intermediate_size", 16)
            super().__init__(parent, **kwargs)

    # ~2.5 min on 2 cores (the tensor-parallel and FSDP tests start two processes each), so in CI's slow run.
    @pytest.mark.slow
    class HybridModelTest(CausalLMModelTest, unittest.TestCase):
        model_tester_class = HybridModelTester

        def setUp(self):
            super().setUp()
            # What being a model inside Transformers gives: the common tests find a class's task (which labels to
            # build, which classes train) by its name in the Auto mappings' name tables, and the tensor-parallel and
            # FSDP mixins run for the model types they list.
            for table, name in MODEL_NAMES.items():
                self.enterContext(mock.patch.dict(getattr(modeling_auto, table), {"hybrid": name}))
            for module, attribute in DISTRIBUTED_MODEL_TYPES:
                self.enterContext(mock.patch.object(module, attribute, getattr(module, attribute) | {"hybrid"}))

        def test_custom_4d_attention_mask(self):
            """Transformers' test skips every config with a sliding window: it runs here on full-attention layers. It
            checks the attention's use of a shared-prefix 4D mask; the SSM branch reads a row as one sequence (a
            recurrence has no mask to follow) and adds nothing in this test, as a fresh model's `out_proj` is zero."""
            self.model_tester.layer_types = ["full_attention"] * self.model_tester.num_hidden_layers
            self.model_tester.sliding_window = None
            super().test_custom_4d_attention_mask()

        # The cache checks read the SSM state shapes from these (Mamba's config names by default).
        def _get_conv_state_shape(self, batch_size, config):
            return (batch_size, config.ssm_intermediate_size, config.ssm_conv_kernel_size - 1)

        def _get_recurrent_state_shape(self, batch_size, config):
            return (batch_size, config.ssm_intermediate_size, config.ssm_state_size)

        def is_pipeline_test_to_skip(self, *args, **kwargs):
            # No tiny checkpoint of this model on the Hub (as Mistral's test file says for its own).
            return True

else:

    @pytest.mark.skip(reason=SKIP_REASON)
    def test_transformers_common_suite():
        """Stands for the common suite where it can't be imported, so a run shows that it did not run, and why."""


def test_generate_compiles_the_decode_step_into_one_graph_on_the_references():
    """What `_can_compile_fullgraph` declares, and what the common suite's static-cache, fullgraph-compile and custom
    4D mask tests are gated on: `generate()` on a HybridStaticCache compiles its decode step with `fullgraph=True`
    (forced on CPU, as the common test does; aot_eager keeps it fast) and gives the uncompiled dynamic cache's tokens
    and logits. On CPU the SSM's decode ops are the references: no graph break in them either."""
    assert HybridForCausalLM._can_compile_fullgraph
    torch.manual_seed(0)
    model = randomize_(HybridForCausalLM(tiny_config())).eval()
    input_ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager")
    compile_config._compile_all_devices = True  # Transformers compiles on accelerators only unless told so
    kwargs = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    torch.compiler.reset()
    with torch.no_grad():
        expected = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
        compiled = model.generate(
            input_ids,
            attention_mask=attention_mask,
            cache_implementation="static",
            compile_config=compile_config,
            **kwargs,
        )
    assert hasattr(model, "_compiled_call"), "generate() compiled the decode step"
    assert isinstance(compiled.past_key_values, HybridStaticCache)
    assert torch.equal(compiled.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(expected.logits), atol=1e-5, rtol=1e-5)


def test_the_static_cache_reports_its_buffer_lengths():
    """Each layer of a HybridStaticCache reports the length of its attention buffer (the common suite's attention
    checks size a static cache's keys by it). Transformers' static hybrid layers report -1 ("no maximum"): their SSM
    mixin comes first in the MRO."""
    config = tiny_config(sliding_window=6, layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2)
    cache = HybridStaticCache(config, max_cache_len=9)
    assert [cache.get_max_length(layer) for layer in range(2)] == [6, 9]
    assert HybridStaticCache(config, max_cache_len=4).get_max_length(0) == 4, "a window wider than the cache"

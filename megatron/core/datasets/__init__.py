"""Data pipeline: Megatron .bin/.idx datasets, GPT samples, blends, mock data, samplers.

Entry points: ``build_train_valid_test_datasets`` (from ``DataConfig``) and
``build_pretraining_data_loader``.
"""

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.builder import build_train_valid_test_datasets, parse_data_path, parse_split
from megatron.core.datasets.data_samplers import MegatronPretrainingSampler, build_pretraining_data_loader
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset, MockGPTLowLevelDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype

__all__ = [
    "BlendedDataset",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronPretrainingSampler",
    "MockGPTDataset",
    "MockGPTLowLevelDataset",
    "build_pretraining_data_loader",
    "build_train_valid_test_datasets",
    "optimal_dtype",
    "parse_data_path",
    "parse_split",
]

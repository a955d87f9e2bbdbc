"""Data sets, label-skew partitions and federations."""

from fedskew.data.datasets import Dataset, DatasetError, read_idx
from fedskew.data.federated import Federation, build_federation, load_federation
from fedskew.data.partitions import PARTITIONS, PartitionError
from fedskew.data.sources import DATASETS, load_dataset

__all__ = ["DATASETS", "Dataset", "DatasetError", "Federation", "PARTITIONS", "PartitionError",
           "build_federation", "load_dataset", "load_federation", "read_idx"]

"""The documents' per-epoch shuffle against grain's own (`index_shuffle`, `MapDataset.shuffle`), index by index."""

import grain
import numpy as np
import pytest

from metatrain.data.shuffle import DOMAIN, EpochShuffleMapDataset, permutation


@pytest.mark.parametrize("n", [2, 3, 7, 8, 40, 73, 1000, 4097, DOMAIN - 1, DOMAIN])
@pytest.mark.parametrize("seed", [0, 12345, 2**32 - 1])
def test_each_epochs_permutation_is_grains(n, seed):
    perm = permutation(n, seed)
    assert sorted(perm.tolist()) == list(range(n))  # a permutation
    indices = range(n) if n <= 1000 else np.random.default_rng(seed).integers(0, n, 200)
    assert [int(perm[i]) for i in indices] == [
        grain.experimental.index_shuffle(int(i), max_index=n - 1, seed=seed, rounds=4) for i in indices]


@pytest.mark.parametrize("n", [1, 5, 40, DOMAIN + 3])
def test_the_repeated_dataset_reads_what_grains_shuffle_reads(n):
    """Three epochs (each reseeded) of a shard of documents, as the pipeline builds it."""
    docs = grain.MapDataset.range(2 * n)[1::2]
    ours, grains = EpochShuffleMapDataset(docs, seed=9).repeat(), docs.shuffle(seed=9).repeat()
    indices = range(3 * n) if n < 100 else [0, 1, n - 1, n, 2 * n + 7, 3 * n - 1]
    assert [ours[i] for i in indices] == [grains[i] for i in indices]

"""Long Range Arena data: loaders for the released formats and local generators (ListOps, Pathfinder).

Every datamodule reads ``task.data.root`` laid out like the LRA release archive::

    <root>/listops-1000/basic_{train,val,test}.tsv           (ListOps; Source/Target)
    <root>/tsv_data/new_aan_pairs.{train,eval,test}.tsv      (Retrieval / AAN; no header)
    <root>/pathfinder32/<difficulty>/{imgs,metadata}/...     (Pathfinder-32)
    <root>/pathfinder128/<difficulty>/{imgs,metadata}/...    (Path-X)

IMDB (Text) comes through Hugging Face ``datasets`` and CIFAR-10 (Image) through torchvision, as in LRA
(which loads both from TFDS). ``python -m longseq.data.lra.prepare`` writes locally generated ListOps and
Pathfinder in the same formats (seeded; NOT the released splits).

Batches: ``(tokens (B, max_length) long, labels (B,) long)``; Retrieval yields
``(tokens_1, tokens_2, labels)``. Padded tasks pad with token id 0 (``PAD_ID``).
"""

from longseq.data.lra.common import PAD_ID, LraDataModule
from longseq.data.lra.image import LraImageDataModule
from longseq.data.lra.listops import LraListOpsDataModule
from longseq.data.lra.pathfinder import LraPathfinderDataModule
from longseq.data.lra.retrieval import LraRetrievalDataModule
from longseq.data.lra.text import LraTextDataModule

__all__ = [
    "PAD_ID",
    "LraDataModule",
    "LraImageDataModule",
    "LraListOpsDataModule",
    "LraPathfinderDataModule",
    "LraRetrievalDataModule",
    "LraTextDataModule",
]

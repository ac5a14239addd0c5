"""Image-caption loaders for CLIP training and evaluation.

The train loop calls::

    from recipe.config import DataConfig          # also re-exported here
    from recipe.data import build_train_loader, build_eval_loader
    loader = build_train_loader(cfg, tokenize, image_data_config, batch_size, rank, world_size, seed)
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)            # keeps a restored mid-epoch position
        for batch in loader:               # dict: pixel_values, input_ids, attention_mask, captions, keys
            ...
        state = loader.state_dict()        # resume with loader.load_state_dict(state)

Both factories read one :class:`recipe.config.DataConfig`: the training loader its
``train_data``, ``split``, ``workers``, ``shuffle_buffer``, ``num_samples`` and augmentation fields
(never labels); the evaluation loader its ``val_data``, ``val_split``, ``eval_workers`` and, when
set, ``label_column``. Format, columns, ``image_root``, separator and cache settings are shared.

Evaluation data needs no captions when it has labels (zero-shot classification only; batches then
hold ``pixel_values``, ``labels`` and ``keys``): a table without a caption column, or a folder of
class subfolders without metadata file (``DIR/<class>/*.jpg``, e.g. an ImageNet validation folder
``DIR/<wnid>/*.JPEG``), labelled by its folder's index in a ``classes`` mapping given to
:func:`build_eval_loader` (ImageNet: :func:`recipe.zeroshot.imagenet_prompts`) or in sorted order.

How the data of an epoch is laid out (per rank ``r`` of ``W``, batch size ``B``):

* Map-style sources (CSV/TSV, JSON lines, parquet, imagefolder, ``save_to_disk``): a permutation
  of all ``N`` rows seeded by ``(seed, epoch)``; rank ``r`` takes rows ``perm[r::W]``, which makes
  the rank shares disjoint and complete. Every rank yields exactly ``N // W // B`` batches of
  exactly ``B`` samples, so collective ops in the train step stay in lock-step. Batch ``b`` is made
  from the block ``share[b*B:(b+1)*B]``; an unreadable sample is replaced by the next sample of the
  same DataLoader worker's stream (its later blocks, then the leftover tail of the share, then a
  second lap over its own samples, whose reuse is counted as ``repeated``).
* Streamed webdataset shards: ``datasets.IterableDataset.shuffle(seed, buffer)`` with
  ``set_epoch(epoch)``, then ``datasets.distributed.split_dataset_by_node`` (whole shards per rank
  when the shard count divides by ``W``, else every ``W``-th sample), then shards per DataLoader
  worker. Each rank again yields exactly ``N // W // B`` batches (``N`` counted from the tar
  headers or given as ``num_samples``); a worker tops up its last batch from the start of its own
  stream, a rank whose share runs short starts another pass over it (both counted as
  ``repeated``), and a rank whose share is longer than its quota leaves the rest for the next
  epoch's shuffle. Shards of equal size in a number divisible by ``W`` times the worker count make
  every epoch one exact pass; with a shard count not divisible by ``W`` every rank reads all shards.
* Evaluation: rank ``r`` takes a contiguous slice of the rows (or its node split of a stream), in
  order, no shuffling, no augmentation, and the last batch may be short. Samples are never
  repeated or dropped except the counted bad ones.

Batches from DataLoader workers are merged in a fixed round-robin order (worker 0, 1, ...,
skipping workers that have finished), so the sequence of batches does not depend on timing. The
position (epoch, batches consumed, each worker's read position) is what
:meth:`ClipLoader.state_dict` saves; :meth:`ClipLoader.load_state_dict` restores it and the next
batch is exactly the one an uninterrupted run would have produced next, augmentation included.
Augmentation is seeded per sample, from the seed, the epoch, the sample's key and which repeat of it
this is: a sample looks the same at any batch size, accumulation, world size or worker count.

Bad samples -- a missing, unreadable or corrupt image, an empty (``None``/blank) or non-string
caption, an unparsable label, a tar shard that cannot be read to its end -- are skipped and
counted per reason; the first few are logged with their key and origin (``row 5 of
/data/train.csv``, ``tar shard /data/00003.tar, key 000031``; the image path when there is one),
and each epoch ends with a summary line. Counts travel with the batches, so they are exact for
what was consumed, and :meth:`ClipLoader.global_stats` sums them over ranks.

A tar shard cut short anywhere (also exactly between members, without end-of-archive blocks),
corrupt, not a tar at all or gone since start is never an error and never silently shorter:
reading it yields the samples before the damage, then counts one ``unreadable_shard`` (once per
epoch, on the rank that reads it) with a warning naming the shard; counting the samples at start
warns about it too. Epoch lengths come from the counted samples, so a damaged shard only makes
some rank's share short, which the top-up (``repeated``) fills. What no sample can fix is an
error at start naming the thing: a missing path, no readable shard at all, an imagefolder without
images, a column whose type cannot hold what it should (numbers as captions or image paths), or a
label column none of whose first values is a class index.

Training images take a fast path (:mod:`~recipe.data.images`): the crop box is drawn from the
JPEG header with timm's draws under the per-sample seed, large JPEGs are decoded at a reduced scale
(draft mode, within a stated PSNR bound), the crop is resized as uint8 by torch's kernels and each
sample is normalised once, straight into a shared-memory batch -- the same boxes, flips and
normalisation as timm's transform, pixels within one level of 255 of it but for a few. Where that
path cannot reproduce the transform (colour jitter) timm's runs. ``decode_device="cuda"``
(``--decode-device cuda``, :mod:`~recipe.data.device_decode`) leaves the JPEG bytes to the training
process, which decodes them with nvJPEG and crops, resizes, flips and normalises on its GPU (same
crop boxes: one sampler serves both paths); ``pixel_values`` then arrive on that device. Evaluation
keeps timm's transform.

Modules: :mod:`~recipe.data.paths` (paths, format detection), :mod:`~recipe.data.formats`
(map-style sources, image bytes), :mod:`~recipe.data.webdataset` (tar shards),
:mod:`~recipe.data.classfolder` (class subfolders without captions), :mod:`~recipe.data.decode`
(skip reasons, cleaning, image pipelines, transforms, collation), :mod:`~recipe.data.images` (the
training images' fast path: crop boxes, draft decoding, uint8 resize, normalisation),
:mod:`~recipe.data.device_decode` (training images decoded on the GPU), :mod:`~recipe.data.plans`
(per-rank plans and cursors), :mod:`~recipe.data.producer` (the batch producer each worker runs),
:mod:`~recipe.data.loader` (:class:`ClipLoader`, factories). Zero-shot prompt files are
:mod:`recipe.zeroshot`.
"""

from recipe.config import DataConfig

from .decode import (
    REPEATED,
    SKIP_REASONS,
    Sample,
    SampleDecoder,
    build_train_pipeline,
    build_transform,
    clean_caption,
    collate,
)
from .formats import clean_label, expand_braces, expand_paths
from .loader import ClipLoader, build_eval_loader, build_train_loader, open_source, read_captions

__all__ = [
    "REPEATED",
    "SKIP_REASONS",
    "ClipLoader",
    "DataConfig",
    "Sample",
    "SampleDecoder",
    "build_eval_loader",
    "build_train_loader",
    "build_train_pipeline",
    "build_transform",
    "clean_caption",
    "clean_label",
    "collate",
    "expand_braces",
    "expand_paths",
    "open_source",
    "read_captions",
]

"""Outputs and sources in object storage (S3, GCS, Azure, any fsspec filesystem), by job:

- :mod:`~imgpack.storage.location`: a path or an fsspec URL, its filesystem, the store's errors;
- :mod:`~imgpack.storage.cache`: the checked local cache an output in a bucket is read through;
- :mod:`~imgpack.storage.lazy`: the same cache file by file, for readers that fetch each shard
  when they first read it, within a limit;
- :mod:`~imgpack.storage.files`: what a reader holds of an opened output's files (pins,
  prefetch);
- :mod:`~imgpack.storage.destination`: writing an output to a bucket (built locally, uploaded,
  the manifest last).

Opening an output is :func:`imgpack.opening.open_output`'s; a conversion source in a bucket is
listed or downloaded by :mod:`imgpack.sources.listing`.
"""

"""Write the example data sets the file configs read (jobs/configs/*-files.yaml):

    python jobs/example_data.py [DIR]      # default: data/ (relative to where you run it)

- DIR/digits/: scikit-learn's 1,797 digits as Parquet, 4 files: `id`, `pixels` (8×8 float32
  intensities 0–16, as Arrow's fixed-shape tensor type) and `digit`;
- DIR/digit-images/: the same digits as 8×8 grayscale PNGs, a folder per class (0/ ... 9/);
- DIR/corpus/: a text corpus for charlm, a directory of files (Python's standard-library
  modules, copied; ~2 MB).
"""

from __future__ import annotations

import argparse
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CORPUS_BYTES = 2_000_000


def write_digits_parquet(out: Path, files: int = 4) -> int:
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = digits.images.astype(np.float32)
    ids = np.arange(len(pixels))
    out.mkdir(parents=True, exist_ok=True)
    for i, rows in enumerate(np.array_split(ids, files)):
        table = pa.table(
            {
                "id": ids[rows],
                "pixels": pa.FixedShapeTensorArray.from_numpy_ndarray(pixels[rows]),
                "digit": digits.target[rows].astype(np.int64),
            }
        )
        pq.write_table(table, out / f"part-{i}.parquet")
    return len(ids)


def write_digit_images(out: Path, every: int = 1) -> int:
    """Every `every`-th digit as a PNG (all by default); returns how many were written."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = digits.images[::every], digits.target[::every]
    for i, (image, label) in enumerate(zip(images, labels, strict=True)):
        folder = out / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        grey = np.round(image * (255 / 16)).astype(np.uint8)  # the set's 0–16 → 0–255
        Image.fromarray(grey, mode="L").save(folder / f"{i:04d}.png")
    return len(images)


def write_corpus(out: Path, limit: int = CORPUS_BYTES) -> int:
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        shutil.copyfile(source, out / f"{source.stem}.txt")
        total += source.stat().st_size
        if total >= limit:
            break
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", default="data", type=Path)
    root = parser.parse_args().dir
    print(f"{root / 'digits'}: {write_digits_parquet(root / 'digits')} rows")
    print(f"{root / 'digit-images'}: {write_digit_images(root / 'digit-images')} images")
    print(f"{root / 'corpus'}: {write_corpus(root / 'corpus')} bytes")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Set everything up and run the main job on a built-in sample: generate a seeded sample image
# folder, convert it to every format (raw pixels at a fixed size, and original bytes), print
# `imgpack info` for each and a read-throughput table from `imgpack bench`, drawn as a chart
# into sample/bench.png.
# Outputs go to ./sample/ (or the folder given as the first argument).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=plot source scripts/setup_env.sh

OUT="${1:-sample}"
rm -rf "$OUT"
mkdir -p "$OUT"
imgpack sample "$OUT/images" --images 300 --classes 5 --seed 0

outputs=()
for fmt in $(python -c "from imgpack.converters import FORMATS; print(*FORMATS)"); do
    imgpack convert "$OUT/images" "$OUT/$fmt-raw" --format "$fmt" --encoding raw --size 64 --quiet
    imgpack convert "$OUT/images" "$OUT/$fmt-original" --format "$fmt" --encoding original --quiet
    outputs+=("$OUT/$fmt-raw" "$OUT/$fmt-original")
done

for out in "${outputs[@]}"; do
    echo
    imgpack info "$out"
done
echo
imgpack bench "$OUT/images" "${outputs[@]}" --workers 0,2 --samples 5000 --plot "$OUT/bench.png"

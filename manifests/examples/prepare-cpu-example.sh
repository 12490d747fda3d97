#!/usr/bin/env bash
# Puts what manifests/examples/modeldeployment-cpu.yaml reads in place on the `models` volume
# (manifests/examples/models-volume.yaml): the model package lowered from a SavedModel at
# DIR/example-cnn/package, and an empty engine store at DIR/engines that the build Job (uid 65532)
# writes the verified engine into.
#
#   bash manifests/examples/prepare-cpu-example.sh DIR [SAVEDMODEL]
#
# DIR is the volume's directory (/var/lib/kubetrt/models for models-volume.yaml, or where an RWX
# volume is mounted). Without SAVEDMODEL the example Keras CNN is written first (TensorFlow: the
# kubetrt[lower] extra). Needs the `kubetrt` CLI with that extra; run as root to hand the store over.
set -euo pipefail
DIR="${1:?usage: prepare-cpu-example.sh DIR [SAVEDMODEL]}"
SAVEDMODEL="${2:-}"
NAME=example-cnn  # spec.model.name and metadata.name of the ModelDeployment: /v2/models/example-cnn, svc/example-cnn
KUBETRT="${KUBETRT:-kubetrt}"
mkdir -p "$DIR"
if [ -z "$SAVEDMODEL" ]; then
  SAVEDMODEL="$DIR/.savedmodel/$NAME"
  rm -rf "$SAVEDMODEL"
  "${PYTHON:-python3}" -c 'import sys; from kubetrt.pipeline.demo import build_example_savedmodel as b; b(sys.argv[1])' "$SAVEDMODEL"
fi
rm -rf "$DIR/$NAME/package"
mkdir -p "$DIR/$NAME"
"$KUBETRT" lower "$SAVEDMODEL" -o "$DIR/$NAME/package" --name "$NAME" --version 1
mkdir -p "$DIR/engines"
# Pods run as 65532:65532: they read the package and the build Job writes the store (a hostPath
# volume ignores the pods' fsGroup, so the directories are handed over here).
chmod -R a+rX "$DIR/$NAME"
if [ "$(id -u)" = 0 ]; then chown -R 65532:65532 "$DIR/engines"; else chmod -R a+rwX "$DIR/engines"; fi
echo "package: $DIR/$NAME/package (pvc://models/$NAME/package), store: $DIR/engines (pvc://models/engines)"

#!/usr/bin/env bash
# Puts the Kafka 4.1 broker's jars (scripts/kafka/pom.xml, from Maven Central) in
# ${CHUNNEL_KAFKA_LIBS:-$HOME/.cache/chunnel/kafka-4.1.0/libs} and prints that directory.
# Does nothing but print it when the jars are already there (a `.complete` marker).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
libs="${CHUNNEL_KAFKA_LIBS:-$HOME/.cache/chunnel/kafka-4.1.0/libs}"
if [ ! -f "$libs/.complete" ]; then
  mkdir -p "$libs"
  timeout 600 mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies \
    -DoutputDirectory="$libs" -DincludeScope=runtime >&2
  touch "$libs/.complete"
fi
echo "$libs"

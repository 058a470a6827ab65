#!/bin/bash
# Here, not on the device: move the tracked bulk out of the checkout for a call that carries a GGUF part,
# so that the tree and the part fit the 64 MiB a call may send, or bring it back.
#   a: keep the drafter's config and weights (call 1, with .carry/a);  b: no drafter (call 2, with .carry/b)
#   restore: put everything back.   HOLD (default ../hold beside the checkout) keeps what is moved.
set -e
cd "$(git rev-parse --show-toplevel)"; H=${HOLD:-../hold}; D=drafter/SmolLM2-135M-Instruct-DFlash-b16
KEEP=${KEEP:-results/h200-2026-12-04-phase13}   # the session folder that stays in the tree
case $1 in
  a|b) mkdir -p $H/results $H/drafter
       for f in results/*; do case " $KEEP " in *" $f "*) ;; *) mv $f $H/results/ ;; esac; done
       [ -d conformance ] && mv conformance $H/
       for f in $D/*; do case $(basename $f) in config.json|model.safetensors) [ $1 = b ] && mv $f $H/drafter/ ;; *) mv $f $H/drafter/ ;; esac; done ;;
  restore) mv $H/results/* results/ 2>/dev/null || true; [ -d $H/conformance ] && mv $H/conformance . ; mv $H/drafter/* $D/ 2>/dev/null || true ;;
  *) echo "usage: stage.sh a|b|restore"; exit 2 ;;
esac
echo "tracked bytes in the tree: $(git ls-files | while read f; do [ -f "$f" ] && stat -c %s "$f"; done | awk '{s+=$1} END {print s}')"

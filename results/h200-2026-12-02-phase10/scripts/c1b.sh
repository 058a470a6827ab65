# Calls 1a-1c (the second start, the first machine having gone back): stash one GGUF part each, so that
# every call can carry the drafter too. Usage: bash c1b.sh PART
STASH=/root/stash; mkdir -p $STASH; cp .carry/p*/$1 $STASH/ && ls $STASH

mkdir -p /root/stash && cp .carry/g4/part00 .carry/g4/part01 /root/stash/ && ls -la /root/stash

mkdir -p /root/stash && for p in .carry/g4/part0*; do cp $p /root/stash/; done; ls -la /root/stash

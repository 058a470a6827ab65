"""The CLI's default pair and default prompt on this CPU (float32, 2 threads), for the scripts beside this file."""
import torch, dflash, offline


def load():
    """-> target, drafter, tokenizer, the default prompt's ids through the chat template."""
    torch.set_num_threads(2)
    tp, dp = offline.default_pair()
    target = dflash.load_target(str(tp), torch.float32, "cpu")
    drafter = dflash.load_drafter(str(dp), target, torch.float32, "cpu")
    tok = offline.load_tokenizer(str(tp))
    return target, drafter, tok, offline.encode_prompt(tok, dflash.parse_args([]).prompt, True)

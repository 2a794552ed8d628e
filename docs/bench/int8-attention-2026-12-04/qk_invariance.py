import torch, itertools
torch.manual_seed(0)
for threads in (1, 2):
    torch.set_num_threads(threads)
    bad = 0; total = 0
    for L in (37, 64, 100, 333, 400, 517):
        kvh, d = 3, 64
        k = torch.randn(kvh, L + 64, d)
        q = torch.randn(kvh, 3 * 8, d)
        ref = (q[:, :3, None, :] * k[:, None, :L, :]).sum(-1)  # one token (3 query heads), exact length
        for extra_q, extra_k, slots in itertools.product((0, 3, 9, 21), (0, 1, 13, 64), (1, 4, 16)):
            qq = q[:, : 3 + extra_q]
            kk = k[:, : L + extra_k]
            if slots > 1:  # batch with other slots
                qq = torch.cat([qq] + [torch.randn_like(qq) for _ in range(slots - 1)], 0)
                kk = torch.cat([kk] + [torch.randn_like(kk) for _ in range(slots - 1)], 0)
            out = (qq[:, :, None, :] * kk[:, None, :, :]).sum(-1)[:kvh, :3, :L]
            total += 1
            bad += not torch.equal(out, ref)
    print(f"threads {threads}: QK^T fp32 differs in {bad} of {total} shapes")

# Does a bf16 matmul give a row the same bits whatever the other rows and their number? (one thread)
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
for (o,i) in ((1536,576),(576,1536),(49152,576)):
    W = torch.randn(o,i).bfloat16()
    X = torch.randn(16,i).bfloat16()
    Y = X @ W.t()
    bad_pos = 0; bad_m1 = 0; bad_m = {}
    for r in range(16):
        for j in (0, 5, 15):
            X2 = torch.randn(16,i).bfloat16(); X2[j] = X[r]
            if not torch.equal((X2 @ W.t())[j], Y[r]): bad_pos += 1
        if not torch.equal((X[r:r+1] @ W.t())[0], Y[r]): bad_m1 += 1
    for m in (1,2,3,8,9,17,32):
        Xm = torch.randn(m,i).bfloat16(); Xm[0] = X[0]
        bad_m[m] = int(not torch.equal((Xm @ W.t())[0], Y[0]))
    print(o,i,"position-dependent rows:",bad_pos,"/48", " M=1 vs M=16 differ:",bad_m1,"/16", "row0 differs at M=",bad_m)

import torch, itertools
from fp4select import validate
from fp4select.backends import triton_hopper as th
from fp4select.keys import Problem, m_bucket
bad=0; n_ok=0
for (n,k),(layout,alpha,od),m,(bt,st,sp) in itertools.product([(520,2080),(4096,4096),(136,256)],[("128x4","scalar","bfloat16"),("8x4","per_token","float16"),("128x4","none","float16")],[1,5,16,33,64],[(16,2,1),(16,3,4),(32,3,2),(64,2,8)]):
    if bt < min(m,64) and bt!=16: pass
    p=Problem(n=n,k=k,m_bucket=m_bucket(m),a_sf_layout=layout,alpha_kind=alpha,out_dtype=od)
    inp=validate.make_inputs(p,m,"cuda",seed=m+n)
    try:
        out=th.run_direct(*inp.args(p),block_t=bt,stages=st,split=sp)
        r=validate.check(out,inp,p.torch_out_dtype)
        if r.ok: n_ok+=1
        else:
            bad+=1; print("WRONG",n,k,layout,alpha,od,m,bt,st,sp,r.reason[:200])
    except Exception as e:
        bad+=1; print("ERR",n,k,m,bt,st,sp,type(e).__name__,str(e)[:300])
print("direct check: ok",n_ok,"bad",bad)

import asyncio, httpx, sys, time, collections, json
U=sys.argv[1]; N=int(sys.argv[2]); path=sys.argv[3]
async def one(c,i):
    body={"model":"demo","prompt":"x","raw":True,"stream":i%2==0,"options":{"num_predict":50}} if path=="/api/generate" else {"model":"demo","messages":[{"role":"user","content":"x"}],"max_tokens":50,"stream":i%2==0}
    try:
        r=await c.post(U+path,json=body)
        t=r.text
        tail=t.strip().split("\n")[-1]
        kind="ok"
        if r.status_code==200 and ("error" in tail): kind="err-in-stream:"+tail[:100]
        if r.status_code!=200:
            try: json.loads(t); kind="json"
            except Exception: kind="nonjson:"+t[:80]
        return (r.status_code, kind)
    except Exception as e:
        return ("exc", repr(e)[:80])
async def main():
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=N)) as c:
        t0=time.time()
        res=await asyncio.gather(*(one(c,i) for i in range(N)))
        print(collections.Counter(res), round(time.time()-t0,1))
asyncio.run(main())

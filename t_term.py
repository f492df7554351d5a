import json, time, threading, os, signal, urllib.request, sys, subprocess
PORT=19450; pid=int(open("/tmp/testerE/gw1.pid").read())
out={}
def stream(i, np):
    t0=time.time(); n=0; last=b""
    try:
        r=urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{PORT}/api/generate", data=json.dumps({"model":"demo","prompt":"t%d"%i,"options":{"num_predict":np}}).encode()), timeout=120)
        for line in r: n+=1; last=line
        out[i]=("ok", n, round(time.time()-t0,2), last[-160:])
    except Exception as e:
        out[i]=("exc", n, round(time.time()-t0,2), repr(e)[:200], last[-200:])
def queued(i):
    t0=time.time()
    try:
        r=urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{PORT}/api/generate", data=json.dumps({"model":"demo","prompt":"q%d"%i,"stream":False,"options":{"num_predict":3}}).encode()), timeout=120)
        out["q%d"%i]=(r.status, r.read()[:100], round(time.time()-t0,2))
    except urllib.error.HTTPError as e:
        out["q%d"%i]=(e.code, dict(e.headers).get("Retry-After"), e.read()[:300], round(time.time()-t0,2))
    except Exception as e:
        out["q%d"%i]=("exc", repr(e)[:200], round(time.time()-t0,2))
ths=[threading.Thread(target=stream,args=(i,12000)) for i in range(2)]
for t in ths: t.start()
time.sleep(1.0)
qs=[threading.Thread(target=queued,args=(i,)) for i in range(2)]
for t in qs: t.start()
time.sleep(0.5)
kids=subprocess.run(["pgrep","-P",str(pid)],capture_output=True,text=True).stdout.split()
print("children", kids)
t0=time.time(); os.kill(pid, signal.SIGTERM)
time.sleep(0.3)
# new request after SIGTERM
try:
    r=urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{PORT}/api/generate", data=json.dumps({"model":"demo","prompt":"late","stream":False,"options":{"num_predict":2}}).encode()), timeout=10)
    print("late", r.status, r.read()[:200])
except urllib.error.HTTPError as e: print("late", e.code, e.read()[:300])
except Exception as e: print("late exc", repr(e)[:200])
for t in ths+qs: t.join()
while True:
    try: os.kill(pid,0)
    except ProcessLookupError: break
    time.sleep(0.2)
    if time.time()-t0>90: print("still alive"); break
print("gateway exit after", round(time.time()-t0,2))
for k in kids:
    print(k, "alive" if os.path.exists(f"/proc/{k}") else "gone")
for k,v in out.items(): print(k, v)

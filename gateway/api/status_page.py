"""``GET /gateway``: a small live status page (no build step, no external assets).

Inline JS polls ``/gateway/api/workers`` once a second and draws one row per worker
(GPU, state, slot bar busy/total, KV fill bar, deferred, tokens/s, restarts), the queue,
GPU samples and the recent errors. Each worker row has ``data-worker="<id>"``.
``GET /`` stays Ollama's "Ollama is running".
"""

from __future__ import annotations

from aiohttp import web

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>llama-gateway</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .3em} .muted{color:#777}
table{border-collapse:collapse;margin:.8em 0;background:#fff}
th,td{border:1px solid #ddd;padding:.3em .6em;text-align:left;white-space:nowrap}
th{background:#f0f0f0}
.bar{display:inline-block;width:120px;height:12px;background:#e6e6e6;vertical-align:middle;margin-right:.4em}
.bar>i{display:block;height:100%;background:#3a7bd5}
.kv>i{background:#8e44ad}
.st-ready{color:#1e8e3e}.st-starting,.st-draining{color:#b06000}.st-backoff,.st-wedged,.st-failed,.st-stopped{color:#c5221f}
#errors li{font-family:monospace;font-size:12px}
</style></head><body>
<h1>llama-gateway</h1>
<div class="muted" id="summary">loading…</div>
<table id="workers"><thead><tr><th>worker</th><th>model</th><th>GPU</th><th>state</th>
<th>slots busy/total</th><th>KV fill</th><th>deferred</th><th>tokens/s</th>
<th title="relative decode speed the scheduler uses (measured per-sequence tokens/s)">speed</th><th>GPU util / mem</th>
<th>restarts</th><th>pid</th></tr></thead><tbody></tbody></table>
<h2 style="font-size:1.1em">Recent errors</h2><ul id="errors"><li class="muted">none</li></ul>
<script>
"use strict";
function esc(s){return String(s==null?"":s).replace(/[&<>"']/g,c=>({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"}[c]));}
function bar(frac,cls,label){const p=Math.max(0,Math.min(1,frac||0))*100;
  return '<span class="bar '+cls+'"><i style="width:'+p.toFixed(0)+'%"></i></span>'+esc(label);}
function gb(b){return (b/1073741824).toFixed(1)+" GiB";}
async function tick(){
  try{
    const tok=new URLSearchParams(location.hash.slice(1)).get("token");
    const r=await fetch("/gateway/api/workers",{cache:"no-store",headers:tok?{"Authorization":"Bearer "+tok}:{}});
    const d=await r.json(); if(!r.ok){document.getElementById("summary").textContent=d.error||("HTTP "+r.status);return;}
    const q=d.queue; const ready=d.workers.filter(w=>w.state==="ready").length;
    document.getElementById("summary").textContent=ready+"/"+d.workers.length+" workers ready · queue "+
      q.depth+"/"+q.max_pending+" · in flight "+d.in_flight+(d.shutting_down?" · SHUTTING DOWN":"")+
      " · updated "+new Date().toLocaleTimeString();
    const rows=d.workers.map(w=>{
      const g=w.gpu; const kv=w.kv_fill==null?"-":bar(w.kv_fill,"kv",(w.kv_fill*100).toFixed(0)+"%");
      return '<tr data-worker="'+esc(w.id)+'"><td>'+esc(w.id)+'</td><td>'+esc(w.model)+'</td><td>'+
        esc(w.gpus.length?w.gpus.join("+"):"cpu")+'</td><td class="st-'+esc(w.state)+'" title="'+esc(w.detail)+'">'+
        esc(w.state)+(w.detail?" ("+esc(w.detail)+")":"")+'</td><td>'+bar(w.slots?w.busy/w.slots:0,"",w.busy+"/"+w.slots)+
        '</td><td>'+kv+'</td><td>'+(w.deferred==null?"-":esc(w.deferred))+'</td><td>'+
        (w.tokens_per_s==null?"-":esc(w.tokens_per_s))+'</td><td>'+esc(w.speed)+
        (w.sequence_tokens_per_s==null?"":" ("+esc(w.sequence_tokens_per_s)+"/s)")+'</td><td>'+
        (g?esc(g.util_percent)+"% / "+gb(g.memory_used_bytes)+" of "+gb(g.memory_total_bytes):"-")+
        '</td><td>'+esc(w.restarts)+'</td><td>'+esc(w.pid||"-")+'</td></tr>';});
    document.querySelector("#workers tbody").innerHTML=rows.join("");
    const errs=d.recent_errors.map(e=>'<li>'+esc(new Date(e.time*1000).toLocaleTimeString())+" "+esc(e.source)+": "+esc(e.message)+'</li>');
    document.getElementById("errors").innerHTML=errs.length?errs.join(""):'<li class="muted">none</li>';
  }catch(e){document.getElementById("summary").textContent="gateway unreachable: "+e;}
}
tick(); setInterval(tick,1000);
</script></body></html>
"""


async def page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE, content_type="text/html", headers={"Cache-Control": "no-cache"})


def routes() -> list[web.RouteDef]:
    return [web.get("/gateway", page), web.get("/gateway/", page)]

// The chat page `turbospark serve` answers at /: one self-contained HTML file (no external
// scripts or fonts), streaming replies from /v1/chat/completions, a stop button, the
// conversation kept in the page, a temperature field, and a small markdown renderer (code
// blocks, inline code, bold, paragraphs; everything else shown as text, HTML escaped).
// tests/server/test_page.py drives it in headless Chromium.
namespace turbospark::cli {

extern const char* const kChatPageHtml;
const char* const kChatPageHtml = R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>turbospark</title>
<style>
body{font-family:system-ui,sans-serif;margin:0;display:flex;flex-direction:column;height:100vh;background:#f6f6f4}
header{padding:.6em 1em;background:#20232a;color:#eee;font-weight:600}
#log{flex:1;overflow-y:auto;padding:1em;max-width:52em;width:100%;box-sizing:border-box;margin:0 auto}
.msg{margin:.6em 0;padding:.6em .9em;border-radius:8px;line-height:1.45;white-space:normal}
.user{background:#dbe9ff}.assistant{background:#fff;border:1px solid #ddd}.error{background:#fdd}
pre{background:#20232a;color:#eee;padding:.6em;border-radius:6px;overflow-x:auto}code{font-family:ui-monospace,monospace}
form{display:flex;gap:.5em;padding:.8em;max-width:52em;width:100%;box-sizing:border-box;margin:0 auto}
textarea{flex:1;font:inherit;padding:.5em;min-height:3em}button{font:inherit;padding:0 1.2em}
</style></head><body>
<header>turbospark <span id="model" style="font-weight:400;opacity:.7"></span></header>
<div id="log"></div>
<form id="f"><textarea id="in" placeholder="Message (Enter sends, Shift+Enter: new line)"></textarea>
<button id="send" type="submit">Send</button><button id="stop" type="button" disabled>Stop</button>
<button id="clear" type="button">Clear</button>
<label title="sampling temperature (0: greedy)" style="align-self:center">temp <input id="temp" type="number" min="0" max="2" step="0.1" value="0.7" style="width:4em"></label></form>
<script>
const log=document.getElementById('log'),input=document.getElementById('in'),send=document.getElementById('send'),
      stopb=document.getElementById('stop');
let messages=[],ctrl=null;
fetch('/v1/models').then(r=>r.json()).then(j=>{document.getElementById('model').textContent=j.data[0].id}).catch(()=>{});
function esc(s){return s.replace(/&/g,'&amp;').replace(/</g,'&lt;').replace(/>/g,'&gt;')}
function md(s){
  const parts=s.split(/```/);let out='';
  parts.forEach((p,i)=>{
    if(i%2){const nl=p.indexOf('\n');out+='<pre><code>'+esc(nl>=0?p.slice(nl+1):p)+'</code></pre>';return}
    let h=esc(p).replace(/`([^`]+)`/g,'<code>$1</code>').replace(/\*\*([^*]+)\*\*/g,'<b>$1</b>');
    out+=h.split(/\n{2,}/).map(x=>x.replace(/\n/g,'<br>')).join('<p>');
  });
  return out;
}
function add(role,text){const d=document.createElement('div');d.className='msg '+role;d.innerHTML=md(text);
  log.appendChild(d);log.scrollTop=log.scrollHeight;return d}
async function ask(){
  const text=input.value.trim();if(!text||ctrl)return;input.value='';
  messages.push({role:'user',content:text});add('user',text);
  const box=add('assistant','');let reply='';
  ctrl=new AbortController();send.disabled=true;stopb.disabled=false;
  try{
    const r=await fetch('/v1/chat/completions',{method:'POST',headers:{'Content-Type':'application/json'},
      body:JSON.stringify({messages,stream:true,temperature:Math.min(2,Math.max(0,parseFloat(document.getElementById('temp').value)||0))}),
      signal:ctrl.signal});
    if(!r.ok){const j=await r.json().catch(()=>({}));throw new Error((j.error&&j.error.message)||('HTTP '+r.status))}
    const rd=r.body.getReader(),dec=new TextDecoder();let buf='';
    for(;;){const {value,done}=await rd.read();if(done)break;buf+=dec.decode(value,{stream:true});
      let i;while((i=buf.indexOf('\n\n'))>=0){const ev=buf.slice(0,i);buf=buf.slice(i+2);
        if(!ev.startsWith('data: '))continue;const data=ev.slice(6);if(data==='[DONE]')continue;
        const j=JSON.parse(data);if(j.error)throw new Error(j.error.message);
        const c=j.choices&&j.choices[0]&&j.choices[0].delta&&j.choices[0].delta.content;
        if(c){reply+=c;box.innerHTML=md(reply);log.scrollTop=log.scrollHeight}}}
  }catch(e){if(e.name!=='AbortError'){box.className='msg error';box.textContent=e.message}}
  messages.push({role:'assistant',content:reply});ctrl=null;send.disabled=false;stopb.disabled=true;input.focus();
}
document.getElementById('f').onsubmit=e=>{e.preventDefault();ask()};
input.onkeydown=e=>{if(e.key==='Enter'&&!e.shiftKey){e.preventDefault();ask()}};
stopb.onclick=()=>{if(ctrl)ctrl.abort()};
document.getElementById('clear').onclick=()=>{if(ctrl)ctrl.abort();messages=[];log.innerHTML=''};
</script></body></html>
)HTML";

}  // namespace turbospark::cli

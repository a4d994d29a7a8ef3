#!/usr/bin/env python3
"""The file-level import graph of the workspace's crates, and its circles (issue 42).

Every source file is a node; an edge goes from a file to each file it names through a
path: `use crate::…`, `use super::…`, `self::…`, `rulebook_core::…`/`rulebook_kube::…`,
an inline `crate::a::b` or `super::x`, or `child::x` for a module it declares. A path
that ends at a `pub use` re-export is followed to the file that defines the item, so a
file that imports `super::Limits` depends on `limits.rs`, not on the façade `mod.rs`
that re-exports it. `#[cfg(test)]` code is left out (tests may reach anywhere).

One kind of edge is not counted: a module's own file (`mod.rs`, `lib.rs`) naming its
submodules. That file declares the module's structure and is its façade; its children
may use what it defines (the rule type whose methods they implement) and it calls them.
Two siblings importing each other, or a child and a file outside its module, are
circles. Exits 1 listing each circle (its files and the edges between them), 0 with
"import circles: 0". `tests/layering.rs` runs it, also on a tree with a planted circle.

  import-cycles.py [NAME=DIR ...]   crates to read (default: the workspace's three)
"""
import os,re,sys
FACADE=True
args=[a for a in sys.argv[1:] if '=' in a]
roots=dict(a.split('=',1) for a in args) or {'rulebook':'src','rulebook_core':'crates/rulebook-core/src','rulebook_kube':'crates/rulebook-kube/src'}
if not args:
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
files={}
for crate,root in roots.items():
    for d,_,fs in os.walk(root):
        for f in fs:
            if f.endswith('.rs'):
                p=os.path.join(d,f); rel=os.path.relpath(p,root)[:-3].split(os.sep)
                if rel[-1] in ('mod','lib','main'): rel=rel[:-1]
                files[p]=(crate,tuple(rel))
mods={(c,m):p for p,(c,m) in files.items()}
def code(s):
    s=re.sub(r'//[^\n]*','',s)
    i=s.find('#[cfg(test)]')
    return s[:i] if i>=0 else s
src={p:code(open(p).read()) for p in files}
decl={p:set(re.findall(r'^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;',src[p],re.M)) for p in files}
def expand(prefix, body):
    body=body.strip()
    m=re.match(r'^([\w:]*?)(::)?\{(.*)\}$',body,re.S)
    if m:
        head,inner=m.group(1),m.group(3); depth=0;cur='';parts=[]
        for ch in inner:
            if ch=='{':depth+=1
            if ch=='}':depth-=1
            if ch==',' and depth==0: parts.append(cur);cur=''
            else: cur+=ch
        parts.append(cur)
        base=prefix+[x for x in head.split('::') if x]
        out=[]
        for q in parts:
            if q.strip(): out+=expand(base,q)
        return out
    return [prefix+[x for x in body.split(' as ')[0].strip().split('::') if x]]
def resolve(crate, segs):
    for n in range(len(segs),-1,-1):
        if (crate,tuple(segs[:n])) in mods: return mods[(crate,tuple(segs[:n]))], segs[n:]
    return None,None
def abspath(p, segs):
    crate,me=files[p]
    if segs[0]=='crate': return crate, list(segs[1:])
    if segs[0]=='self': return crate, list(me)+segs[1:]
    if segs[0]=='super':
        cur=list(me); i=0
        while i<len(segs) and segs[i]=='super': cur=cur[:-1]; i+=1
        return crate, cur+segs[i:]
    if segs[0] in decl[p]: return crate, list(me)+segs
    if segs[0] in ('rulebook_core','rulebook_kube'): return segs[0], list(segs[1:])
    return None,None
reexp={}
for p in files:
    for m in re.finditer(r'\bpub(?:\([^)]*\))?\s+use\s+([^;]*);',src[p],re.S):
        for segs in expand([],m.group(1)):
            if segs and segs[-1]!='*': reexp[(p,segs[-1])]=segs
def target(p,segs,depth=0):
    c,a=abspath(p,segs)
    if c is None: return None
    if c=='rulebook' and a and a[0] in ('meta','render','rules') : c='rulebook_core'
    if c=='rulebook' and a and a[0] in ('cache','write','counts') and ('rulebook',(a[0],)) not in mods: c='rulebook_kube'
    t,rest=resolve(c,a)
    if t and rest and (t,rest[0]) in reexp and depth<5:
        t2=target(t,reexp[(t,rest[0])]+rest[1:],depth+1)
        if t2: return t2
    return t
edges={}
for p in files:
    paths=[]
    for m in re.finditer(r'\buse\s+([\w:{}\s,*]+?);',src[p],re.S):
        paths+=expand([],m.group(1))
    for m in re.finditer(r'(?<![\w:])((?:crate|super|self)(?:::\w+)+)',src[p]):
        paths.append(m.group(1).split('::'))
    for m in re.finditer(r'(?<![\w:])(\w+)::(\w+)',src[p]):
        if m.group(1) in decl[p]: paths.append([m.group(1),m.group(2)])
    e=set()
    for s in paths:
        if not s: continue
        t=target(p,s)
        if not t or t==p: continue
        if FACADE and files[t][0]==files[p][0] and os.path.basename(p) in ('mod.rs','lib.rs','main.rs') and files[t][1][:len(files[p][1])]==files[p][1]: continue
        e.add(t)
    edges[p]=e
sys.setrecursionlimit(10000)
index={};low={};st=[];on=set();sccs=[];c=[0]
def sc(v):
    index[v]=low[v]=c[0];c[0]+=1;st.append(v);on.add(v)
    for w in edges[v]:
        if w not in index: sc(w);low[v]=min(low[v],low[w])
        elif w in on: low[v]=min(low[v],index[w])
    if low[v]==index[v]:
        comp=[]
        while True:
            w=st.pop();on.discard(w);comp.append(w)
            if w==v:break
        if len(comp)>1:sccs.append(comp)
for v in edges:
    if v not in index: sc(v)
for comp in sccs:
    s=set(comp); print('circle of %d files:' % len(comp))
    for v in sorted(comp): print('   ',v,'->',', '.join(sorted(w for w in edges[v] if w in s)))
print('import circles:',len(sccs))
sys.exit(1 if sccs else 0)

//! The workloads one contender runs: converge, update, steady state and template change
//! in one namespace, and the memory-at-scale run in a fresh process per size.

use super::*;

impl Bench {
    /// A phase that waits for the parents to reach a state: says how it ended (`what`:
    /// the phase's name and the word for done) and reports it between the two readings,
    /// with its timeline. `driver`: the driver's own writes, taken out of the counts.
    fn timed_phase(
        &self,
        kind: Kind,
        (what, done): (&str, &str),
        (from, to): (&Snap, &Snap),
        (secs, ok, timeline): (f64, bool, Vec<(f64, usize)>),
        driver: &[(&str, f64)],
    ) -> Json {
        eprintln!(
            "bench: [{}] {what}: {} in {secs:.2} s",
            kind.name(),
            if ok { done } else { "TIMED OUT" }
        );
        let mut phase = self.phase(from, to, Some(secs), Some(ok), driver);
        phase["timeline"] = json!(timeline);
        phase
    }

    /// Converge, update, steady state and (Rulebook) template change, in one
    /// namespace with one controller process.
    pub(crate) async fn workloads(&mut self, kind: Kind) -> Result<Json> {
        let n = self.cfg.n;
        let ns = format!("bench-{}-{}-{}", kind.name(), self.seq, self.run_id);
        let mut out = json!({});
        // Rulebook reads a copy of the rule, so that the template can change under it.
        let dir = tempfile::tempdir()?;
        let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
        copy_tree(&self.cfg.repo.join("benches/rules"), &rules)?;
        copy_tree(&self.cfg.repo.join("benches/templates"), &templates)?;

        cluster::create_namespace(&self.client, &ns).await?;
        self.current = Some((ns.clone(), kind.user_agent()));
        self.prepare(kind).await?;
        let mut p = self
            .start(
                kind,
                &ns,
                &rules,
                &templates,
                &format!("workloads-{}", self.seq),
            )
            .await?;
        self.after_start(kind).await?;
        let api = self.parent_api(kind, &ns);
        let tracker = cluster::ParentTracker::start(api).await?;
        let timeout = self.cfg.timeout_for(n);

        // Converge.
        eprintln!("bench: [{}] converge: creating {n} parents", kind.name());
        let s0 = self.snap(&p).await;
        let t0 = Instant::now();
        self.create_parents(kind, &ns, n).await?;
        let created = t0.elapsed().as_secs_f64();
        let mut timeline = vec![(0.0, 0)];
        let ok = cluster::wait_count(t0, n, timeout, || tracker.converged(1), &mut timeline).await;
        let secs = t0.elapsed().as_secs_f64();
        // The work the converge's writes bring back counts for the converge.
        let settled = self.settle(&p).await;
        let s1 = self.snap(&p).await;
        let mut phase = self.timed_phase(
            kind,
            ("converge", "converged"),
            (&s0, &s1),
            (secs, ok, timeline),
            &[("POST benches", n as f64)],
        );
        phase["parents_created_seconds"] = json!(created);
        phase["settled_seconds"] = json!(settled);
        out["converge"] = phase;
        if !ok || !p.alive() {
            self.notes.push(format!(
                "{}: converge did not finish ({} of {n}); later workloads skipped",
                self.who(kind),
                tracker.converged(1)
            ));
            self.teardown(p, kind, &ns, n).await?;
            return Ok(out);
        }

        // Update.
        if self.cfg.wants("update") || self.cfg.wants("steady") {
            eprintln!("bench: [{}] update: changing {n} parents", kind.name());
            let t0 = Instant::now();
            self.update_parents(kind, &ns, n).await?;
            let mut timeline = vec![(0.0, 0)];
            let ok =
                cluster::wait_count(t0, n, timeout, || tracker.converged(2), &mut timeline).await;
            let secs = t0.elapsed().as_secs_f64();
            // Writes that trail convergence count for the update, not the steady window.
            let settled = self.settle(&p).await;
            let s2 = self.snap(&p).await;
            let mut phase = self.timed_phase(
                kind,
                ("update", "converged"),
                (&s1, &s2),
                (secs, ok, timeline),
                &[("PATCH benches", n as f64)],
            );
            phase["children_checked"] = json!(self.check_children(kind, &ns, n).await);
            phase["settled_seconds"] = json!(settled);
            out["update"] = phase;

            // Steady state.
            if ok && self.cfg.wants("steady") {
                let w = self.cfg.steady_seconds;
                eprintln!("bench: [{}] steady state: watching for {w} s", kind.name());
                tokio::time::sleep(Duration::from_secs(w)).await;
                let s3 = self.snap(&p).await;
                let mut phase = self.phase(&s2, &s3, None, None, &[]);
                phase["converged_after"] = json!(tracker.converged(2));
                eprintln!(
                    "bench: [{}] steady state: {} writes, {:.2} CPU s",
                    kind.name(),
                    phase["writes_total"],
                    phase["cpu_seconds"].as_f64().unwrap_or(0.0)
                );
                out["steady"] = phase;
            }
        }

        // Template change (Rulebook only).
        if kind == Kind::Rulebook && self.cfg.wants("template") {
            // Done when every parent reports the new rule version (status.ruleVersion)
            // and every ConfigMap — the one child whose template changes — has the new
            // content. The Services and Secrets are not written at all.
            let selector = "app.kubernetes.io/managed-by=rulebook,rulebook.dev/rule=bench";
            let cms = vec![cluster::api(
                &self.client,
                Some(&ns),
                "v1",
                "ConfigMap",
                "configmaps",
            )];
            let children = cluster::FieldTracker::start(cms, selector, "/data/revision").await?;
            let parents = cluster::FieldTracker::start(
                vec![self.parent_api(kind, &ns)],
                "",
                "/status/ruleVersion",
            )
            .await?;
            let path = templates.join("bench/configmap.yaml");
            let edited = std::fs::read_to_string(&path)?.replace(
                "  data: {{ parent.spec.data }}\n",
                "  data: {{ parent.spec.data }}\n  revision: \"2\"\n",
            );
            let tmp = templates.join("bench/.configmap.yaml.tmp");
            std::fs::write(&tmp, &edited)?;
            let set = rulebook::render::load(&rules, &templates, &Default::default())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let old_version = set.rules["bench"].version.clone();
            std::fs::rename(&tmp, &path)?;
            let set = rulebook::render::load(&rules, &templates, &Default::default())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let version = set.rules["bench"].version.clone();
            if version == old_version {
                bail!("the template edit did not change the rule version");
            }
            eprintln!(
                "bench: [{}] template change: {old_version} → {version}",
                kind.name()
            );
            let s = self.snap(&p).await;
            let t0 = Instant::now();
            let mut timeline = vec![(0.0, 0)];
            let ok = cluster::wait_count(
                t0,
                n,
                timeout,
                || children.count("2").min(parents.count(&version)),
                &mut timeline,
            )
            .await;
            let secs = t0.elapsed().as_secs_f64();
            let settled = self.settle(&p).await;
            let s2 = self.snap(&p).await;
            let mut phase = self.timed_phase(
                kind,
                ("template change", "rolled out"),
                (&s, &s2),
                (secs, ok, timeline),
                &[],
            );
            phase["children"] = json!(n);
            phase["settled_seconds"] = json!(settled);
            phase["key"] = json!(format!("{} and parents' {}", children.key(), parents.key()));
            out["template"] = phase;
        }
        drop(tracker);
        self.teardown(p, kind, &ns, n).await?;
        Ok(out)
    }

    /// Spot-checks that the update reached the children: the ConfigMaps of a few parents
    /// carry the new data.
    pub(crate) async fn check_children(&self, kind: Kind, ns: &str, n: usize) -> String {
        let cms = cluster::api(&self.client, Some(ns), "v1", "ConfigMap", "configmaps");
        let picks = [0, n / 2, n.saturating_sub(1)];
        let mut good = 0;
        for i in picks {
            let want = Self::parent(kind, ns, i, 2)["spec"]["data"].clone();
            if let Ok(o) = cms.get(&format!("b-{i:05}-config")).await
                && o.data["data"]["data"] == want
            {
                good += 1;
            }
        }
        format!(
            "{good}/{} sampled ConfigMaps carry the updated data",
            picks.len()
        )
    }

    /// RSS with `m` parents (3 × that many children) in the caches, in a fresh process.
    pub(crate) async fn scale(&mut self, kind: Kind, m: usize) -> Result<Json> {
        let ns = format!(
            "bench-scale-{}-{m}-{}-{}",
            kind.name(),
            self.seq,
            self.run_id
        );
        let dir = tempfile::tempdir()?;
        let (rules, templates) = (dir.path().join("rules"), dir.path().join("templates"));
        copy_tree(&self.cfg.repo.join("benches/rules"), &rules)?;
        copy_tree(&self.cfg.repo.join("benches/templates"), &templates)?;
        cluster::create_namespace(&self.client, &ns).await?;
        self.current = Some((ns.clone(), kind.user_agent()));
        self.prepare(kind).await?;
        let tag = format!("scale-{m}-{}", self.seq);
        let p = self.start(kind, &ns, &rules, &templates, &tag).await?;
        self.after_start(kind).await?;
        let idle = p.usage();
        let tracker = cluster::ParentTracker::start(self.parent_api(kind, &ns)).await?;
        eprintln!(
            "bench: [{}] memory at scale: creating {m} parents (round {})",
            kind.name(),
            self.round
        );
        let s0 = self.snap(&p).await;
        let t0 = Instant::now();
        self.create_parents(kind, &ns, m).await?;
        let mut timeline = vec![(0.0, 0)];
        let ok = cluster::wait_count(
            t0,
            m,
            self.cfg.timeout_for(m),
            || tracker.converged(1),
            &mut timeline,
        )
        .await;
        let secs = t0.elapsed().as_secs_f64();
        tokio::time::sleep(Duration::from_secs(10)).await;
        let s1 = self.snap(&p).await;
        eprintln!(
            "bench: [{}] memory at scale: {} in {secs:.1} s, RSS {:.1} MiB (peak {:.1})",
            kind.name(),
            if ok { "converged" } else { "TIMED OUT" },
            s1.usage.rss_mib,
            s1.usage.hwm_mib
        );
        let mut phase = self.phase(
            &s0,
            &s1,
            Some(secs),
            Some(ok),
            &[("POST benches", m as f64)],
        );
        phase["parents"] = json!(m);
        phase["children"] = json!(3 * m);
        phase["idle_rss_mib"] = json!(idle.rss_mib);
        phase["timeline"] = json!(timeline);
        drop(tracker);
        self.teardown(p, kind, &ns, m).await?;
        Ok(phase)
    }
}

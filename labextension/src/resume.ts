/**
 * The question a new kernel of a notebook puts when its earlier kernel left a
 * state (c.GpuFrac.resume = "ask": its server or node went away, or it was
 * culled): restore that state, or start fresh. The answer goes to the server,
 * which restarts the kernel taking the state over, or lets it go for good.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { IGpuFracEvent, IKernelStatus } from './api';
import { defaultTrans, ITrans } from './trans';
import { notebookName } from './words';

/** The server's words for the two answers. */
export type ResumeChoice = 'restore' | 'fresh';

export class ResumeQuestion {
  constructor(
    private readonly _settings: ServerConnection.ISettings,
    private readonly _trans: ITrans = defaultTrans
  ) {}

  /** A `resumable` event, heard for any kernel: asked at once, once. */
  handleEvent(event: IGpuFracEvent, notebook: string | null): void {
    if (event.event === 'resumable') {
      this._ask(
        event.kernel_id,
        event.message ?? '',
        event.notebook || notebook
      );
    }
  }

  /** A kernel view that says a state waits (a page opened after the event). */
  handleStatus(status: IKernelStatus | null, notebook: string | null): void {
    const waiting = status?.resumable;
    if (status && waiting) {
      this._ask(
        status.kernel_id,
        waiting.message ?? waiting.ended,
        status.notebook || notebook
      );
    }
  }

  private _ask(kernelId: string, text: string, notebook: string | null): void {
    if (this._asked.has(kernelId)) {
      return;
    }
    this._asked.add(kernelId);
    void this._question(kernelId, text, notebook);
  }

  private async _question(
    kernelId: string,
    text: string,
    notebook: string | null
  ): Promise<void> {
    const trans = this._trans;
    const name = notebookName(notebook);
    const result = await showDialog({
      title: name
        ? trans.__('Restore the earlier state of %1?', name)
        : trans.__('Restore the earlier state of this notebook?'),
      body: text,
      buttons: [
        Dialog.cancelButton({ label: trans.__('Decide Later') }),
        Dialog.okButton({
          label: trans.__('Start Fresh'),
          displayType: 'default',
          actions: ['fresh']
        }),
        Dialog.okButton({ label: trans.__('Restore'), actions: ['restore'] })
      ]
    });
    const choice = result.button.actions.find(
      (action): action is ResumeChoice =>
        action === 'restore' || action === 'fresh'
    );
    if (!result.button.accept || choice === undefined) {
      // Nothing decided: `%gpu restore` in the notebook still takes it over.
      return;
    }
    await this._answer(kernelId, choice);
  }

  private async _answer(kernelId: string, choice: ResumeChoice): Promise<void> {
    const url = URLExt.join(
      this._settings.baseUrl,
      'api',
      'gpufrac',
      'kernels',
      encodeURIComponent(kernelId),
      'resume'
    );
    try {
      const response = await ServerConnection.makeRequest(
        url,
        { method: 'POST', body: JSON.stringify({ choice }) },
        this._settings
      );
      if (!response.ok) {
        console.warn(
          `jupyter-gpufrac: the answer was not taken (${response.status})`
        );
      }
    } catch (err) {
      console.warn('jupyter-gpufrac: the answer did not reach the server', err);
    }
  }

  private _asked = new Set<string>();
}
